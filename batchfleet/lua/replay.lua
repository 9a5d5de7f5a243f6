-- replay.lua: put one dead letter back on its lane as a new entry, unless the lane is at
-- its maximum depth (the same check as submit.lua) or the request was answered already.
--
-- KEYS[1]  lane stream           (bf:{model}:lane:<n>)
-- KEYS[2]  max-depth key         (bf:{model}:max-depth; absent or 0 = unbounded)
-- KEYS[3]  dead-letter stream    (bf:{model}:dead)
-- KEYS[4]  result key            (bf:{model}:result:<id>; only when the request id is known)
-- ARGV[1]  dead-letter entry id
-- ARGV[2]  '1': delete an existing result first (force); '0': leave an answered request
-- ARGV[3..] the original entry's field/value pairs, flattened
--
-- Returns {'replayed', <new entry id>}, {'answered', ''} or {'gone', ''} (no such dead
-- letter), or the error reply 'QUEUEFULL <stream> holds <n> >= <max>'.
if #redis.call('XRANGE', KEYS[3], ARGV[1], ARGV[1]) == 0 then
  return {'gone', ''}
end
if KEYS[4] and ARGV[2] ~= '1' and redis.call('EXISTS', KEYS[4]) == 1 then
  return {'answered', ''}
end
local max = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
if max > 0 then
  local depth = redis.call('XLEN', KEYS[1])
  if depth >= max then
    return redis.error_reply('QUEUEFULL ' .. KEYS[1] .. ' holds ' .. depth .. ' >= ' .. max)
  end
end
if KEYS[4] then
  redis.call('DEL', KEYS[4])
end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
redis.call('XDEL', KEYS[3], ARGV[1])
return {'replayed', id}
