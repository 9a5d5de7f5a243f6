-- tokens.lua: append entries to requests' token streams and publish the deltas' messages,
-- for a whole generation step in one call. The items come packed in one msgpack argument
-- and the messages are encoded here (cmsgpack, cjson): encoding them in the worker, and
-- passing a dozen arguments per delta, cost the worker's threads more Python time than
-- this whole call costs Redis (measured: 27 against 7 microseconds a delta).
--
-- KEYS[1..N]  the items' token streams (bf:{model}:tokens:<id>)
-- ARGV[1]     each stream's approximate MAXLEN
-- ARGV[2]     a msgpack array of N items, in KEYS order, each an array:
--               {seq, ttl, life}                                                 the end
--               {seq, ttl, life, input, text, tokens, reply, json, id, model[, more]}
--                                                                                a delta
--             ttl: seconds to set (0: leave the TTL); life: the writer's attempt at the
--             request (its entry's delivery count; 0: none), negative to be checked
--             (below); reply: the channel to publish the delta's message on ('': none);
--             json: 1 (JSON message) or 0 (msgpack); more: the delta's optional fields
--             (logprobs, tool_calls, token_ids, tool_call_chunks, content,
--             reasoning_content, prompt_tokens, prompt_text, prompt_logprobs,
--             prompt_token_ids: those it has),
--             an array of {name, value, raw}: raw 1 where value is JSON text (an array),
--             0 where it is a string
--
-- Entries: [life,] seq, input, text, tokens[, each of more] (a delta) or [life,] seq,
-- end = 1. Messages: the Delta of docs/protocol.md (v, kind, id, model, seq, input, text,
-- tokens[, each of more, JSON text as the value it holds]). A checked item whose life is
-- below that of the stream's last entry is dropped, message too: a worker that lost the
-- request to another (it stalled, or was cut off, past the fleet's timeouts) writes
-- nothing after the new owner's first entry. So is a checked item whose life is that of
-- the stream's last entry and whose seq is not above it: this attempt wrote it already (a
-- write made again after its answer was lost: Redis ran the call, then the connection
-- died). The worker asks for the check where it may have been taken for dead, for every
-- end, and for every write made again or behind one that failed: it costs an XREVRANGE.
-- A plain delta (10 fields, no `more`: most of them) takes a branch of its own: the same
-- commands, message and reply, without an argument table built and unpacked. Every
-- message of a call reaches subscribers only when the call ends, so its cost is delta
-- latency: Redis's CPU per call of 32 plain deltas, 482 against 560 us (medians of 9).
-- Returns the number of items written.
local maxlen = ARGV[1]
local items = cmsgpack.unpack(ARGV[2])
local written = 0
for i = 1, #KEYS do
  local it = items[i]
  local seq, ttl, life = it[1], it[2], it[3]
  local stale = false
  if life < 0 then
    life = -life
    local last = redis.call('XREVRANGE', KEYS[i], '+', '-', 'COUNT', 1)
    if #last > 0 then
      local f = last[1][2]
      if f[1] == 'life' then
        local was = tonumber(f[2])
        stale = was > life or (was == life and f[3] == 'seq' and tonumber(f[4]) >= seq)
      end
    end
  end
  if not stale and #it == 10 then  -- a plain delta (most): no tables built for it
    written = written + 1
    if life > 0 then
      redis.call('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '*', 'life', life, 'seq', seq,
                 'input', it[4], 'text', it[5], 'tokens', it[6])
    else
      redis.call('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '*', 'seq', seq,
                 'input', it[4], 'text', it[5], 'tokens', it[6])
    end
    if ttl > 0 then
      redis.call('EXPIRE', KEYS[i], ttl)
    end
    if it[7] ~= '' then
      local body = {v = 1, kind = 'delta', id = it[9], model = it[10], seq = seq,
                    input = it[4], text = it[5], tokens = it[6]}
      redis.call('PUBLISH', it[7], it[8] == 1 and cjson.encode(body) or cmsgpack.pack(body))
    end
  elseif not stale then
    written = written + 1
    local args = {'XADD', KEYS[i], 'MAXLEN', '~', maxlen, '*'}
    if life > 0 then
      args[7], args[8] = 'life', life
    end
    local n = #args
    if #it == 3 then
      args[n + 1], args[n + 2], args[n + 3], args[n + 4] = 'seq', seq, 'end', '1'
    else
      args[n + 1], args[n + 2], args[n + 3], args[n + 4] = 'seq', seq, 'input', it[4]
      args[n + 5], args[n + 6], args[n + 7], args[n + 8] = 'text', it[5], 'tokens', it[6]
      for _, field in ipairs(it[11] or {}) do
        n = #args
        args[n + 1], args[n + 2] = field[1], field[2]
      end
    end
    redis.call(unpack(args))
    if ttl > 0 then
      redis.call('EXPIRE', KEYS[i], ttl)
    end
    if #it > 3 and it[7] ~= '' then
      local body = {v = 1, kind = 'delta', id = it[9], model = it[10], seq = seq,
                    input = it[4], text = it[5], tokens = it[6]}
      local more = it[11] or {}
      local json = it[8] == 1
      for _, field in ipairs(more) do
        if field[3] == 0 then
          body[field[1]] = field[2]
        elseif not json then
          body[field[1]] = cjson.decode(field[2])
        end
      end
      local message
      if json then
        message = cjson.encode(body)
        -- JSON text spliced in as given: cjson would write an empty list as {}
        for _, field in ipairs(more) do
          if field[3] == 1 then
            message = string.sub(message, 1, -2) .. ',"' .. field[1] .. '":' .. field[2] .. '}'
          end
        end
      else
        message = cmsgpack.pack(body)
      end
      redis.call('PUBLISH', it[7], message)
    end
  end
end
return written
