-- claim_due.lua: claim the scheduled deliveries that are due, for one webhooks worker.
--
-- A claimed entry stays in the set with its score moved to now + lease: the worker queues
-- the task, then removes the entry. If it dies in between, the entry is due again when the
-- lease ends and another worker queues it (at least once; webhook-id dedupes).
--
-- KEYS[1]  scheduled set   (bf:webhooks:scheduled)
-- ARGV[1]  now, unix ms
-- ARGV[2]  at most this many entries
-- ARGV[3]  lease, ms
--
-- Returns {claimed members, score of the earliest entry left (false when empty)}.
local now = tonumber(ARGV[1])
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
for _, member in ipairs(due) do
  redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[3]), member)
end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {due, first[2] or false}
