-- refresh.lua: keep the entries a live worker is still working on from looking abandoned:
-- reset the idle time of each given entry that is still pending on this consumer, so the
-- idle fallback (claim_idle_ms) does not take it. XCLAIM ... JUSTID counts no delivery.
-- Entries acked meanwhile, or taken over by another consumer, are left alone; the latter
-- are reported.
--
-- KEYS[1..L]        the model's lane streams       (bf:{model}:lane:<0..L-1>)
-- ARGV[1]           consumer group name
-- ARGV[2]           this consumer's name
-- then 2 per entry, from ARGV[3]: lane number (0-based), stream entry id
--
-- Returns {refreshed, k1, k2, ...}: how many were refreshed, then the 0-based positions
-- (among the given entries) of those pending on another consumer: taken over by another
-- worker (the idle fallback, while this one was unreachable or stalled), so no longer this
-- worker's to answer.
local group, me = ARGV[1], ARGV[2]
local n = 0
local out = {0}
for a = 3, #ARGV, 2 do
  local stream = KEYS[1 + tonumber(ARGV[a])]
  local id = ARGV[a + 1]
  local p = redis.call('XPENDING', stream, group, id, id, 1)
  if #p > 0 then
    if p[1][2] == me then
      redis.call('XCLAIM', stream, group, me, 0, id, 'JUSTID')
      n = n + 1
    else
      out[#out + 1] = (a - 3) / 2
    end
  end
end
out[1] = n
return out
