-- tokens.lua: append entries to requests' token streams and publish the deltas' messages,
-- for a whole generation step in one call. The items come packed in one msgpack argument
-- and the messages are encoded here (cmsgpack, cjson): encoding them in the worker, and
-- passing a dozen arguments per delta, cost the worker's threads more Python time than
-- this whole call costs Redis (measured: 27 against 7 microseconds a delta).
--
-- KEYS[1..N]  the items' token streams (bf:{model}:tokens:<id>)
-- ARGV[1]     each stream's approximate MAXLEN
-- ARGV[2]     a msgpack array of N items, in KEYS order, each an array:
--               {seq, ttl}                                                the stream's end
--               {seq, ttl, input, text, tokens, reply, json, id, model}   a delta
--               {seq, ttl, input, text, tokens, reply, json, id, model, logprobs}
--             ttl: seconds to set (0: leave the TTL); reply: the channel to publish the
--             delta's message on ('' : none); json: 1 (JSON message) or 0 (msgpack);
--             logprobs: the delta's log-probabilities as JSON text (its request asked)
--
-- Entries: seq, input, text, tokens[, logprobs] (a delta) or seq, end = 1. Messages: the
-- Delta of docs/protocol.md (v, kind, id, model, seq, input, text, tokens[, logprobs]).
-- Returns N.
local maxlen = ARGV[1]
local items = cmsgpack.unpack(ARGV[2])
for i = 1, #KEYS do
  local it = items[i]
  local seq, ttl = it[1], it[2]
  if #it == 2 then
    redis.call('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '*', 'seq', seq, 'end', '1')
  elseif #it == 9 then
    redis.call('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '*',
      'seq', seq, 'input', it[3], 'text', it[4], 'tokens', it[5])
  else
    redis.call('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '*',
      'seq', seq, 'input', it[3], 'text', it[4], 'tokens', it[5], 'logprobs', it[10])
  end
  if ttl > 0 then
    redis.call('EXPIRE', KEYS[i], ttl)
  end
  if #it > 2 and it[6] ~= '' then
    local body = {v = 1, kind = 'delta', id = it[8], model = it[9], seq = seq,
                  input = it[3], text = it[4], tokens = it[5]}
    local message
    if it[7] == 1 then
      message = cjson.encode(body)
      if #it > 9 then  -- spliced in as given: cjson would write an empty list as {}
        message = string.sub(message, 1, -2) .. ',"logprobs":' .. it[10] .. '}'
      end
    else
      if #it > 9 then
        body.logprobs = cjson.decode(it[10])
      end
      message = cmsgpack.pack(body)
    end
    redis.call('PUBLISH', it[6], message)
  end
end
return #KEYS
