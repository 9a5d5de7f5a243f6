-- retire.lua: retire redelivered entries whose request already has a stored result: publish
-- the stored result on the entry's reply channel (its client may only subscribe) and ack
-- the entry, without computing it again. The stored result is never changed.
--
-- KEYS[1..n]        result keys, one per entry     (bf:{model}:result:<id>)
-- KEYS[n+1..n+L]    the model's lane streams       (bf:{model}:lane:<0..L-1>)
-- ARGV[1]           consumer group name
-- ARGV[2]           n, the number of entries
-- then 3 per entry i (1-based), from ARGV[3 + 3*(i-1)]:
--   stream entry id, lane number (0-based), reply channel ('' for none)
--
-- Returns an array of n integers: 1 where the entry was retired, 0 where no result is
-- stored any more (it expired meanwhile; the entry stays pending).
local n = tonumber(ARGV[2])
local out = {}
for i = 1, n do
  local a = 3 + 3 * (i - 1)
  local stored = redis.call('GET', KEYS[i])
  if stored then
    if ARGV[a + 2] ~= '' then
      redis.call('PUBLISH', ARGV[a + 2], stored)
    end
    local stream = KEYS[n + 1 + tonumber(ARGV[a + 1])]
    redis.call('XACK', stream, ARGV[1], ARGV[a])
    redis.call('XDEL', stream, ARGV[a])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
