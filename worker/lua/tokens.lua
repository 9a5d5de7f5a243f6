-- tokens.lua: append deltas to requests' token streams and publish their messages, for a
-- whole generation step in one call (a pipeline costs the worker a command each to build
-- and parse: two or three per delta).
--
-- KEYS[1..N]        the items' token streams        (bf:{model}:tokens:<id>)
-- ARGV[1]           each stream's approximate MAXLEN
-- then per item, in KEYS order: field count F, TTL in seconds (0: leave the TTL), reply
-- channel ('' : none), message, then F field/value pairs
--
-- Returns N.
local maxlen = ARGV[1]
local a = 2
for i = 1, #KEYS do
  local nfields, ttl, reply, message = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), ARGV[a + 2], ARGV[a + 3]
  a = a + 4
  local entry = {}
  for j = 1, 2 * nfields do
    entry[j] = ARGV[a + j - 1]
  end
  a = a + 2 * nfields
  redis.call('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '*', unpack(entry))
  if ttl > 0 then
    redis.call('EXPIRE', KEYS[i], ttl)
  end
  if reply ~= '' then
    redis.call('PUBLISH', reply, message)
  end
end
return #KEYS
