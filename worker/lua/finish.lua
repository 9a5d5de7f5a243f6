-- finish.lua: store a request's result once, publish it, and retire its stream entry.
-- Atomic, so a result is written at most once and an entry is acked only with its result.
--
-- KEYS[1]  result key            (bf:{model}:result:<id>)
-- KEYS[2]  lane stream           (bf:{model}:lane:<n>)
-- ARGV[1]  consumer group name
-- ARGV[2]  stream entry id
-- ARGV[3]  encoded result (msgpack or JSON bytes)
-- ARGV[4]  result TTL in seconds
-- ARGV[5]  reply channel to PUBLISH to, or '' for none
--
-- Returns 1 if this call stored the result, 0 if one was already stored (a redelivery:
-- the stored result stands, nothing is published again).
local written = redis.call('SET', KEYS[1], ARGV[3], 'NX', 'EX', tonumber(ARGV[4]))
if written and ARGV[5] ~= '' then
  redis.call('PUBLISH', ARGV[5], ARGV[3])
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
if written then
  return 1
end
return 0
