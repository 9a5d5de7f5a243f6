-- prune.lua: forget the per-worker entries of workers whose heartbeat is gone: their
-- Celery hostname and what they serve with. A worker writes them with each heartbeat and
-- removes them as it stops; one that died (or was renamed: a restarted pod) leaves them,
-- and without this the hashes grow with every restart. An entry whose heartbeat is older
-- than the timeout, or absent, goes; a worker that comes back writes it again at its next
-- beat. A worker is judged by the longer of the pruner's timeout and its own (the
-- ``heartbeat_timeout_ms`` of its serving entry: fleet-file entries may differ). The
-- heartbeat hash itself is left as it is (``status`` shows stale workers).
--
-- KEYS[1]   the model's heartbeat hash   (bf:{model}:workers)
-- KEYS[2]   the model's serving hash     (bf:{model}:serving; its own timeouts, pruned too)
-- KEYS[3..] other per-worker hashes      (bf:{model}:hostnames)
-- ARGV[1]   now, unix ms (the Redis clock)
-- ARGV[2]   heartbeat timeout, ms
--
-- Returns how many entries were removed.
local now, timeout = tonumber(ARGV[1]), tonumber(ARGV[2])
local beats = {}
local flat = redis.call('HGETALL', KEYS[1])  -- (the worker ACL user has no HKEYS, HGET)
for i = 1, #flat, 2 do
  beats[flat[i]] = tonumber(flat[i + 1])
end
local limits = {}
local cards = redis.call('HGETALL', KEYS[2])
for i = 1, #cards, 2 do
  local ok, card = pcall(cjson.decode, cards[i + 1])
  local own = ok and type(card) == 'table' and tonumber(card['heartbeat_timeout_ms'])
  limits[cards[i]] = own and math.max(own, timeout) or timeout
end
local removed = 0
for k = 2, #KEYS do
  local entries = redis.call('HGETALL', KEYS[k])
  for i = 1, #entries, 2 do
    local beat = beats[entries[i]]
    if beat == nil or now - beat > (limits[entries[i]] or timeout) then
      removed = removed + redis.call('HDEL', KEYS[k], entries[i])
    end
  end
end
return removed
