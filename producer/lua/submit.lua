-- submit.lua: add a request to a lane stream unless the lane is at its maximum depth.
-- Raw clients may EVAL this too (docs/protocol.md); a plain XADD skips the depth check.
--
-- KEYS[1]  lane stream           (bf:{model}:lane:<n>)
-- KEYS[2]  max-depth key         (bf:{model}:max-depth; absent or 0 = unbounded)
-- ARGV[1]  field name: 'msgpack' or 'json'
-- ARGV[2]  the encoded request
--
-- Returns the new entry id, or the error reply 'QUEUEFULL <stream> holds <n> >= <max>'.
local max = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
if max > 0 then
  local depth = redis.call('XLEN', KEYS[1])
  if depth >= max then
    return redis.error_reply('QUEUEFULL ' .. KEYS[1] .. ' holds ' .. depth .. ' >= ' .. max)
  end
end
return redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2])
