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
-- Returns 0 when all slots are in use, else 1 (the slot was taken) or 2 (taken, and the
-- endpoint is slow).
local now = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local cap, taken = tonumber(ARGV[4]), 1
if redis.call('EXISTS', KEYS[2]) == 1 then
  cap, taken = tonumber(ARGV[5]), 2
end
if redis.call('ZCARD', KEYS[1]) >= cap then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return taken
