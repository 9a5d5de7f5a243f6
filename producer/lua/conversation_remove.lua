-- conversation_remove.lua: delete one item of a conversation (its JSON, its place in the
-- order and its bytes in the total, at once); every key's TTL refreshed.
--
-- KEYS[1]  the conversation  (bf:conversations:{<id>}: hash of created_at, metadata, next, bytes)
-- KEYS[2]  its items         (bf:conversations:{<id>}:items: hash of item id -> item JSON)
-- KEYS[3]  their order       (bf:conversations:{<id>}:order: sorted set of item ids by sequence)
-- ARGV[1]  the item's id
-- ARGV[2]  TTL in seconds (0: none, the keys persist)
--
-- Returns 1 (deleted) or 0 (no such item); or the error reply 'NOTFOUND' (no such
-- conversation).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('NOTFOUND')
end
local raw = redis.call('HGET', KEYS[2], ARGV[1])
if not raw then
  return 0
end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HINCRBY', KEYS[1], 'bytes', -#raw)
for i = 1, 3 do
  if tonumber(ARGV[2]) > 0 then
    redis.call('EXPIRE', KEYS[i], ARGV[2])
  else
    redis.call('PERSIST', KEYS[i])
  end
end
return 1
