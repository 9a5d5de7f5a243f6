-- finish.lua: store each result of a batch once, publish it, and retire its stream entry.
-- Atomic per call, so a result is written at most once and an entry is acked only with its
-- result. One call carries a whole batch (or one result): one round trip, one script run.
--
-- KEYS[1..n]           result keys, one per result     (bf:{model}:result:<id>)
-- KEYS[n+1..n+L]       the model's lane streams        (bf:{model}:lane:<0..L-1>)
-- KEYS[n+L+1..2n+L]    token streams, one per result   (bf:{model}:tokens:<id>)
-- ARGV[1]              consumer group name
-- ARGV[2]              n, the number of results
-- ARGV[3]              this consumer's name
-- ARGV[4]              a token stream's approximate MAXLEN
-- then 8 per result i (1-based), from ARGV[5 + 8*(i-1)]:
--   stream entry id, lane number (0-based), encoded result, TTL in seconds,
--   reply channel to PUBLISH to ('' for none),
--   fenced ('1': a generation's attempt, see below; '0': first result stands),
--   the token stream's end seq to append with the result ('' for none),
--   the writer's life (its entry's delivery count, as on its deltas; 0: none)
--
-- A fenced result is a generation's: sampled texts differ between attempts, and a reader
-- follows one attempt's token stream to its result. So an attempt stores nothing once it
-- has been superseded: its entry is pending on another consumer (taken over while this
-- worker stalled or was cut off), or a later attempt's entry is the token stream's last.
-- The end of the token stream is appended in the same call as the result, so a reader
-- never sees one attempt's end beside another's result.
--
-- Returns an array of n integers: 1 where the result is this payload (stored now, or by this
-- same call retried after a lost reply: not published twice), 0 where another one was
-- already stored (a redelivery, or a second entry with the same request id: the stored
-- result stands and is published again on this entry's reply channel, so a client that
-- only subscribes still gets its answer), 2 where this attempt was superseded (nothing
-- written, the entry not acked: its new owner answers it).
local group, n, me, maxlen = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local lanes = #KEYS - 2 * n
local out = {}
for i = 1, n do
  local a = 5 + 8 * (i - 1)
  local id = ARGV[a]
  local stream = KEYS[n + 1 + tonumber(ARGV[a + 1])]
  local tokens = KEYS[n + lanes + i]
  local payload, ttl, reply = ARGV[a + 2], tonumber(ARGV[a + 3]), ARGV[a + 4]
  local seq, life = ARGV[a + 6], tonumber(ARGV[a + 7])
  local superseded = false
  if ARGV[a + 5] == '1' then
    -- pcall: a stream without the group (deleted meanwhile) supersedes nothing
    local p = redis.pcall('XPENDING', stream, group, id, id, 1)
    superseded = type(p) == 'table' and type(p[1]) == 'table' and p[1][2] ~= me
    if not superseded and life > 0 then
      local last = redis.call('XREVRANGE', tokens, '+', '-', 'COUNT', 1)
      if #last > 0 then
        local f = last[1][2]
        superseded = f[1] == 'life' and tonumber(f[2]) > life
      end
    end
  end
  if superseded then
    out[i] = 2
  else
    local fresh = redis.call('SET', KEYS[i], payload, 'NX', 'EX', ttl)
    local written = fresh
    if not fresh then
      local stored = redis.call('GET', KEYS[i])
      if stored == payload then
        -- our own write, retried after a lost reply: it was stored and published then
        written = true
      elseif stored and reply ~= '' then
        redis.call('PUBLISH', reply, stored)
      end
    else
      if reply ~= '' then
        redis.call('PUBLISH', reply, payload)
      end
      if seq ~= '' then
        if life > 0 then
          redis.call('XADD', tokens, 'MAXLEN', '~', maxlen, '*', 'life', life, 'seq', seq,
                     'end', '1')
        else
          redis.call('XADD', tokens, 'MAXLEN', '~', maxlen, '*', 'seq', seq, 'end', '1')
        end
        redis.call('EXPIRE', tokens, ttl)
      end
    end
    redis.call('XACK', stream, group, id)
    redis.call('XDEL', stream, id)
    if written then
      out[i] = 1
    else
      out[i] = 0
    end
  end
end
return out
