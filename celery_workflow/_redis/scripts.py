"""The Lua scripts of :class:`celery_workflow._redis.store.RedisStore` (each operation is one script: atomic).

Every script takes the key prefix as ``ARGV[1]`` and the store's clock (microseconds) as ``ARGV[2]``. Times are
stored as the decimal strings Python sent (a Lua number turned into a string keeps 14 digits, too few for
microseconds since the epoch), and compared as numbers; names of keys
are built from the prefix (a single Redis, not a cluster). A message is the hash ``<p>m:<id>`` (``queue``,
``payload``, ``run``, ``nb`` due time, ``attempts``, ``lease`` end or empty, ``key`` idempotency key or empty,
``exp`` expiry or empty, ``created``); ``<p>due:<queue>`` holds a queue's unleased ids by due time and
``<p>held:<queue>`` its leased ids by lease end.
"""

from __future__ import annotations

# KEYS: none (names are built from ARGV[1], the prefix; a single Redis, not a cluster).
COMMON = """
local p = ARGV[1]
local function mkey(id) return p .. 'm:' .. id end
local function num(v) if v == false or v == nil or v == '' then return nil end return tonumber(v) end
local function idem_key(m)
  local key = redis.call('HGET', mkey(m), 'key')
  if key == false or key == '' then return nil end
  local run = redis.call('HGET', mkey(m), 'run')
  if run ~= false and run ~= '' then return p .. 'idem:r:' .. run .. ':' .. key end
  return p .. 'idem:q:' .. redis.call('HGET', mkey(m), 'queue') .. ':' .. key
end
local function insert(queue, payload, run, due, key)
  local id = tostring(redis.call('INCR', p .. 'seq'))
  local exp = ''
  local decl = redis.call('HGET', p .. 'queues', queue)
  if decl then
    local ttl = cjson.decode(decl)['message_ttl']
    if ttl ~= nil and ttl ~= cjson.null then exp = string.format('%.0f', tonumber(due) + math.floor(ttl * 1000000)) end
  end
  redis.call('HSET', mkey(id), 'queue', queue, 'payload', payload, 'run', run, 'nb', due, 'attempts', 0,
             'lease', '', 'key', key, 'exp', exp, 'created', ARGV[2], 'ff', '', 'lf', '', 'err', '')
  redis.call('ZADD', p .. 'due:' .. queue, due, id)
  redis.call('PUBLISH', p .. 'changes', queue)
  return id
end
local function failed(id, at, err)  -- record a failed delivery in the message's history
  local m = mkey(id)
  local ff = redis.call('HGET', m, 'ff')
  if ff == false or ff == '' then redis.call('HSET', m, 'ff', at) end
  redis.call('HSET', m, 'lf', at)
  if err ~= nil and err ~= '' then redis.call('HSET', m, 'err', err) end
end
local function drop(id, queue)
  local k = idem_key(id)
  if k and redis.call('GET', k) == id then redis.call('DEL', k) end
  redis.call('ZREM', p .. 'due:' .. queue, id)
  redis.call('ZREM', p .. 'held:' .. queue, id)
  redis.call('DEL', mkey(id))
end
"""

# ARGV: prefix, now, queue, payload, run, due, key -> id or 0 (deduplicated)
PUT = (
    COMMON
    + """
local now, queue = tonumber(ARGV[2]), ARGV[3]
local run, key = ARGV[5], ARGV[7]
local idem = nil
if key ~= '' then
  if run ~= '' then idem = p .. 'idem:r:' .. run .. ':' .. key else idem = p .. 'idem:q:' .. queue .. ':' .. key end
  if redis.call('EXISTS', idem) == 1 then return 0 end
end
local id = insert(queue, ARGV[4], run, ARGV[6], key)
if idem then redis.call('SET', idem, id) end
return tonumber(id)
"""
)

# ARGV: prefix, now, lease_until, limit, n, queue_1 .. queue_n, noack_1 .. noack_n ('1' or '0'), lost (the error
# recorded for a lease that ran out)
CLAIM = (
    COMMON
    + """
local now, until_, limit, n = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local found = {}
for i = 1, n do
  local queue = ARGV[5 + i]
  local held = p .. 'held:' .. queue
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', held, '-inf', now)) do  -- leases that ran out: failed deliveries
    redis.call('ZREM', held, id)
    failed(id, redis.call('HGET', mkey(id), 'lease'), ARGV[6 + 2 * n])
    redis.call('HSET', mkey(id), 'lease', '')
    redis.call('ZADD', p .. 'due:' .. queue, redis.call('HGET', mkey(id), 'nb'), id)
  end
  local seen = 0
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', p .. 'due:' .. queue, '-inf', now)) do
    if seen >= limit then break end
    local exp = num(redis.call('HGET', mkey(id), 'exp'))
    if exp == nil or exp > now then
      table.insert(found, {tonumber(redis.call('HGET', mkey(id), 'nb')), tonumber(id), queue, ARGV[5 + n + i]})
      seen = seen + 1
    end
  end
end
table.sort(found, function(a, b) if a[1] == b[1] then return a[2] < b[2] end return a[1] < b[1] end)
local out = {}
for j = 1, math.min(limit, #found) do
  local nb, id, queue, noack = found[j][1], tostring(found[j][2]), found[j][3], found[j][4]
  local attempts = redis.call('HINCRBY', mkey(id), 'attempts', 1)
  local k = idem_key(id)
  if k and redis.call('GET', k) == id then redis.call('DEL', k) end
  redis.call('HSET', mkey(id), 'key', '')
  local payload = redis.call('HGET', mkey(id), 'payload')
  local run = redis.call('HGET', mkey(id), 'run')
  redis.call('ZREM', p .. 'due:' .. queue, id)
  if noack == '1' then
    redis.call('DEL', mkey(id))
  else
    redis.call('HSET', mkey(id), 'lease', ARGV[3])
    redis.call('ZADD', p .. 'held:' .. queue, until_, id)
  end
  table.insert(out, {id, queue, payload, attempts, run, nb})
end
return out
"""
)

# ARGV: prefix, now, op ('ack' | 'release' | 'later' | 'extend'), value, error ('later': recorded with the failure),
# id_1, attempts_1, id_2, attempts_2 ...
SETTLE = (
    COMMON
    + """
local now, op, value = tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local done = 0
for i = 6, #ARGV, 2 do
  local id, attempts = ARGV[i], ARGV[i + 1]
  local m = mkey(id)
  if redis.call('HGET', m, 'attempts') == attempts and (num(redis.call('HGET', m, 'lease')) ~= nil) then
    local queue = redis.call('HGET', m, 'queue')
    if op == 'ack' then
      drop(id, queue)
    elseif op == 'extend' then
      redis.call('HSET', m, 'lease', ARGV[4])
      redis.call('ZADD', p .. 'held:' .. queue, value, id)
    else
      if op == 'later' then
        redis.call('HSET', m, 'nb', ARGV[4])
        failed(id, ARGV[2], ARGV[5])
      end
      redis.call('HSET', m, 'lease', '')
      redis.call('ZREM', p .. 'held:' .. queue, id)
      redis.call('ZADD', p .. 'due:' .. queue, redis.call('HGET', m, 'nb'), id)
      redis.call('PUBLISH', p .. 'changes', queue)
    end
    done = done + 1
  end
end
return done
"""
)

# ARGV: prefix, now, mode ('count' | 'purge'), queue -> the number of waiting messages (counted or deleted)
WAITING = (
    COMMON
    + """
local now, mode, queue = tonumber(ARGV[2]), ARGV[3], ARGV[4]
local ids = redis.call('ZRANGE', p .. 'due:' .. queue, 0, -1)
for _, id in ipairs(redis.call('ZRANGEBYSCORE', p .. 'held:' .. queue, '-inf', now)) do table.insert(ids, id) end
local n = 0
for _, id in ipairs(ids) do
  local exp = num(redis.call('HGET', mkey(id), 'exp'))
  if mode == 'purge' then
    drop(id, queue)
    n = n + 1
  elseif exp == nil or exp > now then
    n = n + 1
  end
end
return n
"""
)

# ARGV: prefix, now, queue_1 .. queue_n -> {queue, microseconds} of each queue's next claimable moment
DUE = (
    COMMON
    + """
local now = tonumber(ARGV[2])
local out = {}
for i = 3, #ARGV do
  local queue = ARGV[i]
  local best = nil
  for _, id in ipairs(redis.call('ZRANGE', p .. 'due:' .. queue, 0, -1)) do
    local exp = num(redis.call('HGET', mkey(id), 'exp'))
    if exp == nil or exp > now then best = tonumber(redis.call('HGET', mkey(id), 'nb')) break end
  end
  local lease = redis.call('ZRANGE', p .. 'held:' .. queue, 0, 0, 'WITHSCORES')
  if lease[2] then
    local l = tonumber(lease[2])
    if l <= now then
      local nb = tonumber(redis.call('HGET', mkey(lease[1]), 'nb'))
      if best == nil or nb < best then best = nb end
    elseif best == nil or l < best then best = l end
  end
  if best ~= nil then table.insert(out, queue) table.insert(out, string.format('%.0f', best)) end
end
return out
"""
)

# ARGV: prefix, now, queue_1 .. queue_n -> the number of messages deleted: those past their time to live
# (``x-message-ttl``) and not under a running lease
EXPIRE = (
    COMMON
    + """
local now = tonumber(ARGV[2])
local n = 0
for i = 3, #ARGV do
  local queue = ARGV[i]
  for _, zset in ipairs({p .. 'due:' .. queue, p .. 'held:' .. queue}) do
    for _, id in ipairs(redis.call('ZRANGE', zset, 0, -1)) do
      local exp, lease = num(redis.call('HGET', mkey(id), 'exp')), num(redis.call('HGET', mkey(id), 'lease'))
      if exp ~= nil and exp <= now and (lease == nil or lease <= now) then drop(id, queue) n = n + 1 end
    end
  end
end
return n
"""
)

# ARGV: prefix, now, queue_1 .. queue_n -> the number of messages deleted (the queues go with their bindings)
DROP_QUEUES = (
    COMMON
    + """
local n = 0
for i = 3, #ARGV do
  local queue = ARGV[i]
  for _, zset in ipairs({p .. 'due:' .. queue, p .. 'held:' .. queue}) do
    for _, id in ipairs(redis.call('ZRANGE', zset, 0, -1)) do drop(id, queue) n = n + 1 end
  end
  redis.call('HDEL', p .. 'queues', queue)
  redis.call('DEL', p .. 'consumers:' .. queue)
  redis.call('SREM', p .. 'consumed', queue)
  for _, exchange in ipairs(redis.call('SMEMBERS', p .. 'bound:' .. queue)) do
    local bkey = p .. 'bind:' .. exchange
    for _, field in ipairs(redis.call('HKEYS', bkey)) do
      if string.sub(field, -string.len(queue) - 1) == '\\0' .. queue then redis.call('HDEL', bkey, field) end
    end
    if redis.call('HLEN', bkey) == 0 then redis.call('SREM', p .. 'exchanges_bound', exchange) end
  end
  redis.call('DEL', p .. 'bound:' .. queue)
end
return n
"""
)

# A dead letter is the hash ``<p>d:<id>`` (ids from ``INCR <p>dseq``); ``<p>dead`` indexes them by id and
# ``<p>unsettled`` holds those whose run has not been failed yet. Fields: ``mid`` (the message's id), ``queue``,
# ``payload``, ``run``, ``attempts``, ``reason``, ``err``, ``ff``/``lf`` first and last failure, ``enq``, ``dead``.
LETTERS = """
local function lkey(id) return p .. 'd:' .. id end
local function selected(ids, queue, run)  -- ids of the letters picked by ARGV (ids: a list, or nil for all)
  local out = {}
  if ids == nil then ids = redis.call('ZRANGE', p .. 'dead', 0, -1) end
  for _, id in ipairs(ids) do
    local q = redis.call('HGET', lkey(id), 'queue')
    if q and (queue == '' or q == queue) and (run == '' or redis.call('HGET', lkey(id), 'run') == run) then
      table.insert(out, id)
    end
  end
  return out
end
local function forget(id)
  redis.call('DEL', lkey(id))
  redis.call('ZREM', p .. 'dead', id)
  redis.call('ZREM', p .. 'unsettled', id)
end
"""

# ARGV: prefix, now, id, attempts, reason, error -> the dead letter's id, or 0 when the receipt is stale
DEAD_LETTER = (
    COMMON
    + LETTERS
    + """
local now, id, attempts, reason, err = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local m = mkey(id)
if redis.call('HGET', m, 'attempts') ~= attempts or num(redis.call('HGET', m, 'lease')) == nil then return 0 end
local f = redis.call('HGETALL', m)
local msg = {}
for i = 1, #f, 2 do msg[f[i]] = f[i + 1] end
if err == '' then err = msg['err'] or '' end
local letter = tostring(redis.call('INCR', p .. 'dseq'))
redis.call('HSET', lkey(letter), 'mid', id, 'queue', msg['queue'], 'payload', msg['payload'], 'run', msg['run'],
           'attempts', msg['attempts'], 'reason', reason, 'err', err, 'ff', msg['ff'] or '', 'lf', msg['lf'] or '',
           'enq', msg['created'], 'dead', now)
redis.call('ZADD', p .. 'dead', tonumber(letter), letter)
if msg['run'] ~= '' then redis.call('ZADD', p .. 'unsettled', tonumber(letter), letter) end
drop(id, msg['queue'])
return tonumber(letter)
"""
)

# ARGV: prefix, now, after, limit, queue ('' any), run ('' any), unsettled ('1': only those) -> letter ids
LIST_LETTERS = (
    COMMON
    + LETTERS
    + """
local after, limit, queue, run = ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6]
local index = p .. 'dead'
if ARGV[7] == '1' then index = p .. 'unsettled' end
local out = {}
local start = '(' .. after
while #out < limit do
  local ids = redis.call('ZRANGEBYSCORE', index, start, '+inf', 'LIMIT', 0, 100)
  if #ids == 0 then break end
  for _, id in ipairs(selected(ids, queue, run)) do
    if #out < limit then table.insert(out, id) end
  end
  start = '(' .. ids[#ids]
end
return out
"""
)

# ARGV: prefix, now, mode ('redrive' | 'purge' | 'settle'), queue ('' any), all ('1': every letter), id_1 .. id_n
# -> the number of letters redriven, purged or settled. A redrive puts the message back due now, attempts reset.
MOVE_LETTERS = (
    COMMON
    + LETTERS
    + """
local mode, queue = ARGV[3], ARGV[4]
local ids = nil
if ARGV[5] ~= '1' then ids = {} for i = 6, #ARGV do table.insert(ids, ARGV[i]) end end
local n = 0
for _, id in ipairs(selected(ids, queue, '')) do
  if mode == 'settle' then
    n = n + redis.call('ZREM', p .. 'unsettled', id)
  else
    if mode == 'redrive' then
      local f = redis.call('HMGET', lkey(id), 'queue', 'payload', 'run')
      insert(f[1], f[2], f[3], ARGV[2], '')
    end
    forget(id)
    n = n + 1
  end
end
return n
"""
)
