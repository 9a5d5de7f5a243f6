-- acquire_slot.lua: take one of an endpoint's delivery slots, if one is free.
--
-- A slot is a lease: a member of the endpoint's in-flight set whose score is the unix ms it
-- ends. Leases of crashed workers expire by themselves; a finished attempt removes its own.
--
-- KEYS[1]  in-flight set of the endpoint   (bf:webhooks:{<endpoint>}:inflight)
-- KEYS[2]  slow marker of the endpoint     (bf:webhooks:{<endpoint>}:slow)
-- ARGV[1]  now, unix ms
-- ARGV[2]  lease token (unique per attempt)
-- ARGV[3]  lease length, ms (longer than an attempt can take)
-- ARGV[4]  cap: slots of the endpoint
-- ARGV[5]  cap while the slow marker exists
--
-- Returns 1 when the slot was taken, 0 when all are in use.
local now = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local cap = tonumber(ARGV[4])
if redis.call('EXISTS', KEYS[2]) == 1 then
  cap = tonumber(ARGV[5])
end
if redis.call('ZCARD', KEYS[1]) >= cap then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
