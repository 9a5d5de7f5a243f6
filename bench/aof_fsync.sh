#!/usr/bin/env bash
# XADD throughput of a local redis-server with AOF off, appendfsync everysec and always
# (docs/deploy.md). 8 clients, 223-byte bodies (a 100-char msgpack request), unpipelined
# and pipelined by 16 (as submit_many does). Usage: bash bench/aof_fsync.sh [requests]
set -euo pipefail
n=${1:-50000}
body=$(head -c 223 /dev/zero | tr '\0' x)
printf '| appendfsync | XADD/s, 1 per round trip | XADD/s, pipelined 16 |\n| --- | --- | --- |\n'
for mode in off everysec always; do
  dir=$(mktemp -d)
  port=$((21000 + RANDOM % 5000))
  if [ "$mode" = off ]; then aof=(--appendonly no); else aof=(--appendonly yes --appendfsync "$mode"); fi
  redis-server --port "$port" --bind 127.0.0.1 --dir "$dir" --save "" "${aof[@]}" \
    --daemonize yes --pidfile "$dir/pid" >/dev/null
  until redis-cli -p "$port" ping >/dev/null 2>&1; do sleep 0.05; done
  rate() { redis-benchmark -p "$port" -c 8 -n "$n" -P "$1" --csv XADD 'bf:{m}:lane:1' '*' msgpack "$body" \
    | tail -1 | cut -d, -f2 | tr -d '"' | cut -d. -f1; }
  printf '| %s | %s | %s |\n' "$mode" "$(rate 1)" "$(rate 16)"
  kill "$(cat "$dir/pid")"; sleep 0.3; rm -rf "$dir"
done
