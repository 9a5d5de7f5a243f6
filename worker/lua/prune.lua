-- prune.lua: forget workers whose heartbeat is gone. A worker writes its per-worker entries
-- with each heartbeat and removes them as it stops; one that died (or was renamed: a
-- restarted pod) leaves them, and without this they grow with every restart.
--
-- * Its Celery hostname and what it serves with go once its heartbeat is older than the
--   timeout, or absent; a worker that comes back writes them again at its next beat.
-- * Its heartbeat goes once older than the dead-worker retention (until then ``status``
--   shows it stale).
-- * Its consumer in each lane's group goes once it holds no pending entry (deleting one
--   that holds entries would drop them from the PEL: lost requests; the takeover moves
--   them first) and is idle (Redis's own clock) as long as the retention, its heartbeat
--   too old or gone. Atomic: nothing can claim for it between the check and the delete,
--   and a dead consumer does not read. One that comes back under the same name is created
--   again by its next XREADGROUP.
--
-- A worker is judged live by the longer of the pruner's timeout and its own (the
-- ``heartbeat_timeout_ms`` of its serving entry: fleet-file entries may differ); the
-- retention applies only past both. The pruner never removes itself.
--
-- KEYS[1]   the model's heartbeat hash   (bf:{model}:workers)
-- KEYS[2]   the model's serving hash     (bf:{model}:serving; its own timeouts, pruned too)
-- KEYS[3]   the model's hostname hash    (bf:{model}:hostnames)
-- KEYS[4..] the model's lane streams     (bf:{model}:lane:<n>)
-- ARGV[1]   now, unix ms (the Redis clock, as the heartbeats are written)
-- ARGV[2]   heartbeat timeout, ms
-- ARGV[3]   dead-worker retention, ms
-- ARGV[4]   the lanes' consumer group
-- ARGV[5]   the pruner's consumer name
--
-- Returns {hostname and serving entries removed, heartbeats removed, consumers deleted}.
local now, timeout, retention = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local group, pruner = ARGV[4], ARGV[5]
local beats = {}
local flat = redis.call('HGETALL', KEYS[1])  -- (the worker ACL user has no HKEYS, HGET)
for i = 1, #flat, 2 do
  beats[flat[i]] = tonumber(flat[i + 1])
end
local limits = {}
local cards = redis.call('HGETALL', KEYS[2])
for i = 1, #cards, 2 do
  local ok, card = pcall(cjson.decode, cards[i + 1])
  local own = ok and type(card) == 'table' and tonumber(card['heartbeat_timeout_ms'])
  limits[cards[i]] = own and math.max(own, timeout) or timeout
end
-- Silent past `bound` (and past its own timeout)? No heartbeat at all counts as silent.
local function silent(name, bound)
  local beat = beats[name]
  return name ~= pruner
    and (beat == nil or now - beat > math.max(bound, limits[name] or timeout))
end

local removed = 0
for k = 2, 3 do
  local entries = redis.call('HGETALL', KEYS[k])
  for i = 1, #entries, 2 do
    if silent(entries[i], timeout) then
      removed = removed + redis.call('HDEL', KEYS[k], entries[i])
    end
  end
end

local forgotten = 0
for name, _ in pairs(beats) do
  if silent(name, retention) then
    forgotten = forgotten + redis.call('HDEL', KEYS[1], name)
  end
end

local deleted = 0
for k = 4, #KEYS do
  local consumers = redis.pcall('XINFO', 'CONSUMERS', KEYS[k], group)
  local err = consumers.err
  if err and not (err:find('^NOGROUP') or err:find('no such key')) then
    return redis.error_reply(err)
  end
  if not err then  -- (no stream or group yet: nothing to delete)
    for _, fields in ipairs(consumers) do
      local c = {}
      for i = 1, #fields, 2 do
        c[fields[i]] = fields[i + 1]
      end
      if c['pending'] == 0 and c['idle'] >= retention and silent(c['name'], retention) then
        redis.call('XGROUP', 'DELCONSUMER', KEYS[k], group, c['name'])
        deleted = deleted + 1
      end
    end
  end
end
return {removed, forgotten, deleted}
