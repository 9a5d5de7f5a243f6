-- finish.lua: store each result of a batch once, publish it, and retire its stream entry.
-- Atomic per call, so a result is written at most once and an entry is acked only with its
-- result. One call carries a whole batch (or one result): one round trip, one script run.
--
-- KEYS[1..n]        result keys, one per result     (bf:{model}:result:<id>)
-- KEYS[n+1..n+L]    the model's lane streams        (bf:{model}:lane:<0..L-1>)
-- ARGV[1]           consumer group name
-- ARGV[2]           n, the number of results
-- then 5 per result i (1-based), from ARGV[3 + 5*(i-1)]:
--   stream entry id, lane number (0-based), encoded result, TTL in seconds,
--   reply channel to PUBLISH to ('' for none)
--
-- Returns an array of n integers: 1 where the result is this payload (stored now, or by this
-- same call retried after a lost reply: not published twice), 0 where another one was
-- already stored (a redelivery, or a second entry with the same request id: the stored
-- result stands and is published again on this entry's reply channel, so a client that
-- only subscribes still gets its answer).
local n = tonumber(ARGV[2])
local out = {}
for i = 1, n do
  local a = 3 + 5 * (i - 1)
  local id = ARGV[a]
  local stream = KEYS[n + 1 + tonumber(ARGV[a + 1])]
  local payload = ARGV[a + 2]
  local written = redis.call('SET', KEYS[i], payload, 'NX', 'EX', tonumber(ARGV[a + 3]))
  if not written then
    local stored = redis.call('GET', KEYS[i])
    if stored == payload then
      -- our own write, retried after a lost reply: it was stored and published then
      written = true
    elseif stored and ARGV[a + 4] ~= '' then
      redis.call('PUBLISH', ARGV[a + 4], stored)
    end
  elseif ARGV[a + 4] ~= '' then
    redis.call('PUBLISH', ARGV[a + 4], payload)
  end
  redis.call('XACK', stream, ARGV[1], id)
  redis.call('XDEL', stream, id)
  if written then
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
