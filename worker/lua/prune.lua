-- prune.lua: forget the per-worker entries of workers whose heartbeat is gone: their
-- Celery hostname and what they serve with. A worker writes them with each heartbeat and
-- removes them as it stops; one that died (or was renamed: a restarted pod) leaves them,
-- and without this the hashes grow with every restart. An entry whose heartbeat is older
-- than the timeout, or absent, goes; a worker that comes back writes it again at its next
-- beat. The heartbeat hash itself is left as it is (``status`` shows stale workers).
--
-- KEYS[1]   the model's heartbeat hash   (bf:{model}:workers)
-- KEYS[2..] per-worker hashes to prune   (bf:{model}:hostnames, bf:{model}:serving)
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
local removed = 0
for k = 2, #KEYS do
  local entries = redis.call('HGETALL', KEYS[k])
  for i = 1, #entries, 2 do
    local beat = beats[entries[i]]
    if beat == nil or now - beat > timeout then
      removed = removed + redis.call('HDEL', KEYS[k], entries[i])
    end
  end
end
return removed
