-- dead_letter.lua: move an entry nobody can be answered for to the dead-letter stream.
--
-- KEYS[1]  dead-letter stream    (bf:{model}:dead)
-- KEYS[2]  lane stream           (bf:{model}:lane:<n>)
-- ARGV[1]  consumer group name
-- ARGV[2]  stream entry id
-- ARGV[3]  error code
-- ARGV[4]  reason (human-readable)
-- ARGV[5]  approximate MAXLEN of the dead-letter stream
-- ARGV[6]  worker name
-- ARGV[7..] the entry's original field/value pairs, flattened
--
-- Returns the dead-letter entry id.
local fields = {'source', KEYS[2], 'source_id', ARGV[2], 'code', ARGV[3], 'reason', ARGV[4],
                'worker', ARGV[6]}
for i = 7, #ARGV, 2 do
  table.insert(fields, 'orig_' .. ARGV[i])
  table.insert(fields, ARGV[i + 1])
end
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', tonumber(ARGV[5]), '*', unpack(fields))
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
return id
