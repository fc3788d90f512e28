"""The Lua scripts behind RedisState: each atomic step of the request and worker life is one script.

Kept apart from redis_state.py so the Python side stays readable; key layouts and argument
orders are documented where each script is called.
"""

# Lua: Redis 7 runs Lua 5.1 with numbers as doubles; ids and epochs travel as strings and are
# compared as strings (the epoch field is always written by HINCRBY, i.e. a plain integer).
TERMINAL_LUA = "local TERMINAL = {finished=true, aborted=true, failed=true, deadline=true}\n"

# KEYS: req, pending, inflight. ARGV: id, gateway, priority, arrival, score, payload, limit, token.
# Returns {status, depth, state}; depth counts every unfinished request (queued or in flight).
ADMIT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local cur = redis.call('HMGET', KEYS[1], 'state', 'admit_token')
  local depth = redis.call('ZCARD', KEYS[2]) + redis.call('ZCARD', KEYS[3])
  if cur[2] == ARGV[8] then
    return {'admitted', depth, cur[1]}  -- a retry of this very call
  end
  return {'duplicate', depth, cur[1]}
end
local depth = redis.call('ZCARD', KEYS[2]) + redis.call('ZCARD', KEYS[3])
if depth >= tonumber(ARGV[7]) then
  return {'full', depth, false}
end
redis.call('HSET', KEYS[1], 'state', 'queued', 'priority', ARGV[3], 'gateway', ARGV[2],
           'attempt', 0, 'epoch', 0, 'arrival', ARGV[4], 'score', ARGV[5],
           'payload', ARGV[6], 'admit_token', ARGV[8])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
return {'admitted', depth + 1, 'queued'}
"""

# KEYS: pending, inflight. ARGV: gateway, lease deadline, scan, req key prefix, request id or ''.
# Returns {id, epoch, attempt} or false.
CLAIM = """
local function take(id, key)
  redis.call('ZREM', KEYS[1], id)
  redis.call('ZADD', KEYS[2], ARGV[2], id)
  redis.call('HSET', key, 'state', 'dispatching')
  local attempt = redis.call('HINCRBY', key, 'attempt', 1)
  local epoch = redis.call('HINCRBY', key, 'epoch', 1)
  return {id, epoch, attempt}
end
if ARGV[5] ~= '' then
  local key = ARGV[4] .. ARGV[5]
  if redis.call('ZSCORE', KEYS[1], ARGV[5]) and redis.call('HGET', key, 'gateway') == ARGV[1] then
    return take(ARGV[5], key)
  end
  return false
end
local ids = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1)
for _, id in ipairs(ids) do
  local key = ARGV[4] .. id
  local gateway = redis.call('HGET', key, 'gateway')
  if gateway == ARGV[1] then
    return take(id, key)
  elseif not gateway then
    redis.call('ZREM', KEYS[1], id)  -- no hash behind it: drop the stray id
  end
end
return false
"""

# KEYS: req, pending, inflight. ARGV: id, epoch or '', now or ''.
REQUEUE = TERMINAL_LUA + """
local cur = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'score')
if not cur[1] or TERMINAL[cur[1]] then return 0 end
if ARGV[2] ~= '' and cur[2] ~= ARGV[2] then return 0 end
if cur[1] == 'queued' then return 1 end
local deadline = redis.call('ZSCORE', KEYS[3], ARGV[1])
if ARGV[3] ~= '' and (not deadline or tonumber(deadline) >= tonumber(ARGV[3])) then return 0 end
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[2], cur[3], ARGV[1])
redis.call('HSET', KEYS[1], 'state', 'queued')
return 1
"""

# KEYS: req. ARGV: epoch, field, value, ...
UPDATE = TERMINAL_LUA + """
local cur = redis.call('HMGET', KEYS[1], 'state', 'epoch')
if not cur[1] or cur[1] == 'queued' or TERMINAL[cur[1]] or cur[2] ~= ARGV[1] then return 0 end
if #ARGV > 1 then redis.call('HSET', KEYS[1], unpack(ARGV, 2)) end
return 1
"""

# KEYS: req, inflight. ARGV: id, epoch, new deadline.
EXTEND = TERMINAL_LUA + """
local cur = redis.call('HMGET', KEYS[1], 'state', 'epoch')
if not cur[1] or cur[1] == 'queued' or TERMINAL[cur[1]] or cur[2] ~= ARGV[2] then return 0 end
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[2], 'XX', ARGV[3], ARGV[1])
return 1
"""

# KEYS: req, pending, inflight. ARGV: id, epoch or '', state, ttl_s, field, value, ...
# 1: the request is now in ARGV[3] (by this call or an earlier one); 0: refused.
FINISH = TERMINAL_LUA + """
local cur = redis.call('HMGET', KEYS[1], 'state', 'epoch')
if not cur[1] then
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[3], ARGV[1])
  return 0
end
if TERMINAL[cur[1]] then return cur[1] == ARGV[3] and 1 or 0 end
if ARGV[2] ~= '' and cur[2] ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HSET', KEYS[1], 'state', ARGV[3], unpack(ARGV, 5))
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""

# KEYS: req, pending. ARGV: id, ttl_s, reason.
CANCEL = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'aborted' then return 1 end
if state ~= 'queued' then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], 'state', 'aborted', 'error', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: w, alive, workers. ARGV: id, ttl_ms, hash_ttl_ms, role, address, transports, stats, now.
REGISTER = """
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'role', ARGV[4], 'address', ARGV[5], 'transports', ARGV[6],
           'stats', ARGV[7], 'updated', ARGV[8])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
redis.call('SADD', KEYS[3], ARGV[1])
return 1
"""

# KEYS: w, alive, workers. ARGV: id, ttl_ms, hash_ttl_ms, stats, now.
# 0 when the worker is not registered or its alive key already expired: it must register again.
HEARTBEAT = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'stats', ARGV[4], 'updated', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
redis.call('SADD', KEYS[3], ARGV[1])
return 1
"""

# KEYS: workers. ARGV: worker key prefix. Returns {id, {field, value, ...}, ...} of live workers;
# dead ones leave the set and lose their hash.
WORKERS = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local key = ARGV[1] .. id
  local fields = false
  if redis.call('EXISTS', key .. ':alive') == 1 then fields = redis.call('HGETALL', key) end
  if fields and #fields > 0 then
    table.insert(out, id)
    table.insert(out, fields)
  else
    redis.call('SREM', KEYS[1], id)
    redis.call('DEL', key, key .. ':alive')
  end
end
return out
"""

# KEYS: w, alive, workers. ARGV: id.
DEREGISTER = """
redis.call('SREM', KEYS[3], ARGV[1])
return redis.call('DEL', KEYS[1], KEYS[2])
"""
