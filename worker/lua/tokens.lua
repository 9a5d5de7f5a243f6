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
--               {seq, ttl, life, input, text, tokens, reply, json, id, model}    a delta
--               {seq, ttl, life, input, text, tokens, reply, json, id, model, logprobs}
--               {seq, ttl, life, input, text, tokens, reply, json, id, model, logprobs,
--                tool_calls}
--               {seq, ttl, life, input, text, tokens, reply, json, id, model, logprobs,
--                tool_calls, content, reasoning_content}
--             ttl: seconds to set (0: leave the TTL); life: the writer's attempt at the
--             request (its entry's delivery count; 0: none), negative to be checked
--             (below); reply: the channel to
--             publish the delta's message on ('' : none); json: 1 (JSON message) or 0
--             (msgpack); logprobs: the delta's log-probabilities as JSON text ('': none);
--             tool_calls: the tool calls it completed, as JSON text ('': none);
--             content, reasoning_content: what it adds to its output's (false: none)
--
-- Entries: [life,] seq, input, text, tokens[, logprobs][, tool_calls][, content]
-- [, reasoning_content] (a delta) or [life,] seq, end = 1. Messages: the Delta of
-- docs/protocol.md (v, kind, id, model, seq, input, text, tokens[, logprobs][, tool_calls]
-- [, content][, reasoning_content]). A checked item whose life is below that of the
-- stream's last entry is dropped, message too: a worker that lost the request to another
-- (it stalled, or was cut off, past the fleet's timeouts) writes nothing after the new
-- owner's first entry. The worker asks for the check where it may have been taken for dead
-- (and for every end): it costs an XREVRANGE.
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
      stale = f[1] == 'life' and tonumber(f[2]) > life
    end
  end
  if not stale then
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
      if #it > 10 and it[11] ~= '' then
        n = #args
        args[n + 1], args[n + 2] = 'logprobs', it[11]
      end
      if #it > 11 and it[12] ~= '' then
        n = #args
        args[n + 1], args[n + 2] = 'tool_calls', it[12]
      end
      if #it > 12 and it[13] then
        n = #args
        args[n + 1], args[n + 2] = 'content', it[13]
      end
      if #it > 13 and it[14] then
        n = #args
        args[n + 1], args[n + 2] = 'reasoning_content', it[14]
      end
    end
    redis.call(unpack(args))
    if ttl > 0 then
      redis.call('EXPIRE', KEYS[i], ttl)
    end
    if #it > 3 and it[7] ~= '' then
      local body = {v = 1, kind = 'delta', id = it[9], model = it[10], seq = seq,
                    input = it[4], text = it[5], tokens = it[6]}
      if #it > 12 and it[13] then
        body.content = it[13]
      end
      if #it > 13 and it[14] then
        body.reasoning_content = it[14]
      end
      local lps = #it > 10 and it[11] ~= '' and it[11] or nil
      local calls = #it > 11 and it[12] ~= '' and it[12] or nil
      local message
      if it[8] == 1 then
        message = cjson.encode(body)
        -- spliced in as given: cjson would write an empty list as {}
        if lps then
          message = string.sub(message, 1, -2) .. ',"logprobs":' .. lps .. '}'
        end
        if calls then
          message = string.sub(message, 1, -2) .. ',"tool_calls":' .. calls .. '}'
        end
      else
        if lps then
          body.logprobs = cjson.decode(lps)
        end
        if calls then
          body.tool_calls = cjson.decode(calls)
        end
        message = cmsgpack.pack(body)
      end
      redis.call('PUBLISH', it[7], message)
    end
  end
end
return written
