-- conversation_write.lua: create a conversation, set its metadata, append items to it, or
-- any of these at once: all or nothing, within its bounds, every key's TTL refreshed. Many
-- gateways may append to one conversation at once: each append is whole and in one order.
--
-- KEYS[1]  the conversation  (bf:conversations:{<id>}: hash of created_at, metadata, next, bytes)
-- KEYS[2]  its items         (bf:conversations:{<id>}:items: hash of item id -> item JSON)
-- KEYS[3]  their order       (bf:conversations:{<id>}:order: sorted set of item ids by sequence)
-- ARGV[1]  created_at: create it, with ARGV[2] ('' : it must exist already)
-- ARGV[2]  its metadata, JSON ('' : unchanged)
-- ARGV[3]  TTL in seconds (0: none, the keys persist)
-- ARGV[4]  the most items it may hold
-- ARGV[5]  the most bytes its items' JSON may hold
-- ARGV[6], ARGV[7], ...  item id, item JSON: the items to append, in order
--
-- Returns {items, bytes} it holds after; or the error reply 'NOTFOUND' (no such
-- conversation), 'EXISTS' (creating one there is), 'DUPLICATE <item id>' (an id it holds,
-- or given twice), 'TOOMANY <items>' or 'TOOBIG <bytes>' (what it would hold).
local exists = redis.call('EXISTS', KEYS[1]) == 1
if ARGV[1] == '' and not exists then
  return redis.error_reply('NOTFOUND')
elseif ARGV[1] ~= '' and exists then
  return redis.error_reply('EXISTS')
end
local count = redis.call('ZCARD', KEYS[3])
local bytes = tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0')
local seen = {}
for i = 6, #ARGV, 2 do
  if seen[ARGV[i]] or redis.call('HEXISTS', KEYS[2], ARGV[i]) == 1 then
    return redis.error_reply('DUPLICATE ' .. ARGV[i])
  end
  seen[ARGV[i]] = true
  count = count + 1
  bytes = bytes + #ARGV[i + 1]
end
if count > tonumber(ARGV[4]) then
  return redis.error_reply('TOOMANY ' .. count)
end
if bytes > tonumber(ARGV[5]) then
  return redis.error_reply('TOOBIG ' .. bytes)
end
if ARGV[1] ~= '' then
  redis.call('HSET', KEYS[1], 'created_at', ARGV[1], 'metadata', '{}', 'next', 0)
end
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], 'metadata', ARGV[2])
end
for i = 6, #ARGV, 2 do
  local seq = redis.call('HINCRBY', KEYS[1], 'next', 1)
  redis.call('ZADD', KEYS[3], seq, ARGV[i])
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
end
redis.call('HSET', KEYS[1], 'bytes', bytes)
for i = 1, 3 do
  if tonumber(ARGV[3]) > 0 then
    redis.call('EXPIRE', KEYS[i], ARGV[3])
  else
    redis.call('PERSIST', KEYS[i])
  end
end
return {count, bytes}
