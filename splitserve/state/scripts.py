"""The Redis keys of the service and the Lua scripts behind ``RedisState``: each atomic step of
the request and worker life is one script.

Keys
----
Every key starts with the hash tag ``{<prefix>}`` (default ``{ss}``), so all of them hash
to one slot and the multi-key scripts also run on Redis Cluster (the whole service state
then lives on one shard).

=============================  ======  =====================================================
key                            type    holds
=============================  ======  =====================================================
``{ss}:q:pending``             ZSET    ids of requests in state ``queued``; score =
                                       ``queue_score(priority, arrival, aging)``: the priority
                                       rule of ``splitserve.engine.priority`` (aging included), lower
                                       first. ZCARD is the queue depth; ``queue_limit`` caps
                                       it plus the in-flight ZCARD.
``{ss}:q:inflight``            ZSET    ids of claimed requests (any non-terminal state after
                                       ``queued``); score = claim lease deadline, Unix s.
``{ss}:q:placing``             ZSET    the claimed request being placed on workers (at most
                                       one); score = deadline of that placement, Unix s.
                                       While it holds one, nobody claims: free capacity goes
                                       to requests in queue order.
``{ss}:req:<request id>``      HASH    ``state``, ``priority``, ``gateway`` (the admitting
                                       gateway), ``arrival`` (Unix s), ``score``, ``attempt``
                                       and ``epoch`` (both +1 per claim; the epoch fences
                                       writes of stale attempts), ``payload`` (JSON object),
                                       ``owner`` (who may read and abort it:
                                       ``splitserve.common.authz``; never a token itself),
                                       ``admit_token`` (makes a retried admit call idempotent)
                                       and whatever ``update``/``finish`` write (worker ids,
                                       timings, ``error``...). No TTL while live; EXPIRE
                                       ``terminal_ttl_s`` once terminal (a new request with
                                       the id may replace it ``id_reuse_after_s`` after the end).
``{ss}:gw:<gateway id>:alive`` STRING  ``1`` with PX = the gateway's liveness TTL: its queued
                                       requests wait for it only while this key exists.
``{ss}:workers``               SET     ids of registered workers (dead ones are pruned by
                                       ``workers()``).
``{ss}:w:<worker id>``         HASH    ``role``, ``address``, ``transports`` (JSON list),
                                       ``stats`` (JSON object: free pages, load...),
                                       ``updated`` (Unix s), ``sig`` and ``stats_sig``
                                       (HMAC-SHA256 with a key derived from the internal
                                       token, "" without one: gateways with the token ignore a
                                       record whose signatures do not verify). PEXPIRE of 10
                                       heartbeat TTLs, so it never outlives a dead worker for long.
``{ss}:w:<worker id>:alive``   STRING  ``1`` with PX = the heartbeat TTL: the worker is alive
                                       exactly while this key exists.
``{ss}:w:<worker id>:prefixes`` HASH   the prefix directory (``splitserve.state.prefixes``):
                                       block chain hash -> tiers (bits: 1 device, 2 host, 4 disk) of
                                       the blocks the worker holds; written by the worker only,
                                       PX refreshed on each update, deleted with the record.
=============================  ======  =====================================================

Pub/sub channel ``{ss}:wake``: ``admit``, ``placed``, ``requeue`` and ``end <request id>``
(FINISH, CANCEL, a claim or reap that fails a dead gateway's request), so every gateway's claim loop
wakes when the head of the queue or the free capacity may have changed, and the gateway that
holds a request hears when someone else ended it.

The request's page lease is not a key of its own (a ``kv:lease:<id>`` would be): the lease deadline is the request's score in ``q:inflight`` and the fencing
token is its ``epoch``. A new key must be added to this table and carry the hash tag.

Request states: ``queued`` -> ``dispatching`` (set by ``claim``) -> any states the caller
writes with ``update`` (``prefilling``, ``decoding``...) -> one terminal state of
``TERMINAL_STATES``. ``requeue`` goes back to ``queued``.

Scripts
-------
``ADMIT``         duplicate check (a live request's id, or one that ended less than
                  ``id_reuse_after_s`` ago), capacity check (pending + in flight < queue_limit),
                  HSET + ZADD.
``CLAIM``         the head of the global queue, if the calling gateway admitted it and no
                  placement is open -> inflight with a lease, placement gate taken; ``attempt``
                  and ``epoch`` +1. Heads of dead gateways are failed on the way. Without the
                  gate (colocated workers only), several consecutive heads at once.
``REAP_ORPHANS``  every queued request of a dead gateway (anywhere in the queue, not only
                  ahead of the head) fails and frees its room; every live gateway's watchdog
                  runs it each round, so they go within the gateway TTL plus a round.
``PLACED``        the placement gate opens.
``GATEWAY_BEAT``  the gateway's alive key.
``REQUEUE``       inflight -> pending with the request's original score, state ``queued``.
``UPDATE``        HSET fields iff the epoch matches and the request is claimed, not terminal.
``EXTEND``        move the lease deadline iff the epoch matches.
``FINISH``        terminal state: out of every queue, fields written, EXPIRE.
``CANCEL``        a still-queued request leaves the queue as ``aborted`` (only for its owner,
                  when one is given).
``REGISTER`` / ``HEARTBEAT`` / ``WORKERS`` / ``DEREGISTER``: the worker registry.

Limitations
-----------
* One global order is strict: the head waits for free capacity and nothing passes it
  (head-of-line blocking, as in vLLM's FCFS and priority queues), and placements happen one
  at a time over all gateways (a claim, a Reserve on a decode worker -- which answers between
  two engine steps -- and PLACED), which bounds the dispatch rate of a disaggregated stack to
  about one request per decode step.
* ``claim`` looks at the first ``claim_scan`` (64) pending ids only (stray ids and requests of
  dead gateways are dropped on the way; the first live one decides).
* Priorities are clamped to ``[PRIORITY_MIN, PRIORITY_MAX]`` in the score (the gateway refuses
  others); arrivals before 2020-01-01 count as 2020-01-01, so ``arrival_s`` must be Unix time.
  Every gateway of one Redis must use the same aging rate (``up`` and compose pass one).
* An id names one request while it is live and for ``id_reuse_after_s`` (10 s) after its end --
  time for every gateway and worker that held it to hear of the end and let go -- then it may
  name a new request (whose record replaces the old one; GetRequest shows the newest). Every
  gateway of one Redis must use the same ``terminal_ttl_s``: the time since the end is read off
  the record's remaining TTL.
* A ``claim`` whose reply is lost (socket timeout after the server ran it) leaves that
  request claimed until its lease expires and the reaper fails it.
"""

# Lua: Redis 7 runs Lua 5.1 with numbers as doubles; ids and epochs travel as strings and are
# compared as strings (the epoch field is always written by HINCRBY, i.e. a plain integer).
TERMINAL_LUA = "local TERMINAL = {finished=true, aborted=true, failed=true, deadline=true}\n"

# KEYS: req, pending, inflight, wake channel, placing.
# ARGV: id, gateway, priority, arrival, score, payload, limit, token, terminal ttl_s, id reuse after s, owner,
# claim lease deadline ('' : queue only), now.
# Returns {status, depth, state} (+ {epoch, attempt} when claimed at once); depth counts every
# unfinished request (queued or in flight).
# With a lease deadline (the caller's placements take no capacity: CLAIM's no-gate case), a request
# that lands at the head of the queue while no placement is open is claimed in the same call, as
# CLAIM would claim it next (state dispatching, attempt and epoch +1, in flight until the
# deadline): the claim loop's round trip saved. Anywhere else in the queue it waits as usual.
# The id of a terminal request is taken again once `id reuse after s` have passed since its end,
# read off its record's remaining TTL (every terminal write sets EXPIRE `terminal ttl_s`). The
# new request keeps the old record's epoch (claims count on from it), so any late write of the
# old request's attempts stays fenced off.
ADMIT = TERMINAL_LUA + """
local depth = redis.call('ZCARD', KEYS[2]) + redis.call('ZCARD', KEYS[3])
local epoch = 0
if redis.call('EXISTS', KEYS[1]) == 1 then
  local cur = redis.call('HMGET', KEYS[1], 'state', 'admit_token', 'epoch', 'attempt', 'admit_claim')
  if cur[2] == ARGV[8] then  -- a retry of this very call (its claim too, if it made one)
    if cur[1] == 'dispatching' and cur[5] == ARGV[8] then return {'admitted', depth, cur[1], cur[3], cur[4]} end
    return {'admitted', depth, cur[1]}
  end
  if not TERMINAL[cur[1]] then return {'duplicate', depth, cur[1]} end
  local ttl = redis.call('TTL', KEYS[1])
  if ttl < 0 or tonumber(ARGV[9]) - ttl < tonumber(ARGV[10]) then return {'duplicate', depth, cur[1]} end
  epoch = cur[3] or 0
end
if depth >= tonumber(ARGV[7]) then
  return {'full', depth, false}
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'state', 'queued', 'priority', ARGV[3], 'gateway', ARGV[2],
           'attempt', 0, 'epoch', epoch, 'arrival', ARGV[4], 'score', ARGV[5],
           'payload', ARGV[6], 'admit_token', ARGV[8], 'owner', ARGV[11])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
if ARGV[12] ~= '' and redis.call('ZRANGE', KEYS[2], 0, 0)[1] == ARGV[1]
    and redis.call('ZCOUNT', KEYS[5], '(' .. ARGV[13], '+inf') == 0 then
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZADD', KEYS[3], ARGV[12], ARGV[1])
  redis.call('HSET', KEYS[1], 'state', 'dispatching', 'admit_claim', ARGV[8])
  local attempt = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
  local claimed_epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
  return {'admitted', depth + 1, 'dispatching', claimed_epoch, attempt}
end
redis.call('PUBLISH', KEYS[4], 'admit')
return {'admitted', depth + 1, 'queued'}
"""

# A queued request whose admitting gateway is gone (its alive key lapsed): nobody holds its client
# stream, so nobody could ever read its tokens. It leaves the queue as failed.
FAIL_ORPHAN_LUA = """
local function fail_orphan(pending, key, id, ttl_s, wake)
  redis.call('ZREM', pending, id)
  redis.call('HSET', key, 'state', 'failed', 'finish_reason', 'error',
             'error', 'the gateway that admitted this request went away')
  redis.call('EXPIRE', key, ttl_s)
  redis.call('PUBLISH', wake, 'end ' .. id)
end
"""

# KEYS: pending, inflight, placing, wake channel.
# ARGV: gateway, lease deadline, scan, req key prefix, gateway alive-key prefix, now, placement deadline,
# ttl_s, max claims, gate ('1': the claimed request holds the placement gate).
# One global order: only the head of the queue may be claimed, and only by the gateway that
# admitted it (it holds the client's stream); while another live gateway's request is at the
# head, or any request is still being placed, nobody claims. Requests whose gateway is gone
# (no alive key) are failed on the way: nobody could stream their tokens. Without the gate
# (placements that take no capacity, e.g. colocated workers that queue requests themselves),
# up to `max claims` consecutive heads of the caller go at once.
# Returns {'claimed', id, epoch, attempt, id, epoch, attempt, ...}, {'wait', why} or {'empty'}.
CLAIM = FAIL_ORPHAN_LUA + """
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[6])
local placing = redis.call('ZRANGE', KEYS[3], 0, 0)
if #placing > 0 then return {'wait', 'placing ' .. placing[1]} end
local gate = ARGV[10] == '1'
local limit = gate and 1 or tonumber(ARGV[9])
local out = {'claimed'}
local ids = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1)
for _, id in ipairs(ids) do
  local key = ARGV[4] .. id
  local gateway = redis.call('HGET', key, 'gateway')
  if gateway == ARGV[1] then
    redis.call('ZREM', KEYS[1], id)
    redis.call('ZADD', KEYS[2], ARGV[2], id)
    if gate then redis.call('ZADD', KEYS[3], ARGV[7], id) end
    redis.call('HSET', key, 'state', 'dispatching')
    local attempt = redis.call('HINCRBY', key, 'attempt', 1)
    local epoch = redis.call('HINCRBY', key, 'epoch', 1)
    table.insert(out, id)
    table.insert(out, epoch)
    table.insert(out, attempt)
    if #out > 3 * limit then return out end
  elseif not gateway then
    redis.call('ZREM', KEYS[1], id)  -- no hash behind it: drop the stray id
  elseif redis.call('EXISTS', ARGV[5] .. gateway .. ':alive') == 1 then
    if #out > 1 then return out end
    return {'wait', 'head ' .. id .. ' of gateway ' .. gateway}
  else
    fail_orphan(KEYS[1], key, id, ARGV[8], KEYS[4])
  end
end
if #out > 1 then return out end
return {'empty'}
"""

# KEYS: pending, wake channel. ARGV: req key prefix, gateway alive-key prefix, ttl_s, scan.
# Every queued request (among the first `scan`) whose gateway is gone is failed, wherever it
# stands in the queue: CLAIM only meets those ahead of the first live gateway's request, and a
# head that waits for room would keep the rest -- and their room under queue_limit -- forever.
# Returns how many were failed.
REAP_ORPHANS = FAIL_ORPHAN_LUA + """
local alive = {}
local failed = 0
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[4]) - 1)) do
  local key = ARGV[1] .. id
  local gateway = redis.call('HGET', key, 'gateway')
  if not gateway then
    redis.call('ZREM', KEYS[1], id)  -- no hash behind it: drop the stray id
  else
    if alive[gateway] == nil then
      alive[gateway] = redis.call('EXISTS', ARGV[2] .. gateway .. ':alive') == 1
    end
    if not alive[gateway] then
      fail_orphan(KEYS[1], key, id, ARGV[3], KEYS[2])
      failed = failed + 1
    end
  end
end
return failed
"""

# KEYS: placing, wake channel. ARGV: id. The request's placement is decided: the next may go.
PLACED = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then redis.call('PUBLISH', KEYS[2], 'placed') end
return 1
"""

# KEYS: alive. ARGV: ttl_ms. A gateway is alive while this key lives.
GATEWAY_BEAT = """
redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
return 1
"""

# KEYS: req, pending, inflight, placing, wake channel. ARGV: id, epoch or '', now or ''.
REQUEUE = TERMINAL_LUA + """
local cur = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'score')
if not cur[1] or TERMINAL[cur[1]] then return 0 end
if ARGV[2] ~= '' and cur[2] ~= ARGV[2] then return 0 end
if cur[1] == 'queued' then return 1 end
local deadline = redis.call('ZSCORE', KEYS[3], ARGV[1])
if ARGV[3] ~= '' and (not deadline or tonumber(deadline) >= tonumber(ARGV[3])) then return 0 end
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('ZADD', KEYS[2], cur[3], ARGV[1])
redis.call('HSET', KEYS[1], 'state', 'queued')
redis.call('PUBLISH', KEYS[5], 'requeue')
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

# KEYS: req, pending, inflight, placing, wake channel. ARGV: id, epoch or '', state, ttl_s, field, value, ...
# 1: the request is now in ARGV[3] (by this call or an earlier one); 0: refused.
FINISH = TERMINAL_LUA + """
local cur = redis.call('HMGET', KEYS[1], 'state', 'epoch')
if not cur[1] then
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[4], ARGV[1])
  return 0
end
if TERMINAL[cur[1]] then return cur[1] == ARGV[3] and 1 or 0 end
if ARGV[2] ~= '' and cur[2] ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('HSET', KEYS[1], 'state', ARGV[3], unpack(ARGV, 5))
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('PUBLISH', KEYS[5], 'end ' .. ARGV[1])
return 1
"""

# KEYS: req, pending, wake channel. ARGV: id, ttl_s, reason, owner check ('1': only for the owner), owner.
# Another owner's request is left alone and answers 0, as an unknown one does.
CANCEL = """
local cur = redis.call('HMGET', KEYS[1], 'state', 'owner')
local state = cur[1]
if ARGV[4] == '1' and (cur[2] or '') ~= ARGV[5] then return 0 end
if state == 'aborted' then return 1 end
if state ~= 'queued' then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], 'state', 'aborted', 'error', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('PUBLISH', KEYS[3], 'end ' .. ARGV[1])
return 1
"""

# KEYS: w, alive, workers. ARGV: id, ttl_ms, hash_ttl_ms, role, address, transports, stats, now,
# sig, stats_sig (the record's signatures, "" without a registry key: RedisState._sign).
REGISTER = """
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'role', ARGV[4], 'address', ARGV[5], 'transports', ARGV[6],
           'stats', ARGV[7], 'updated', ARGV[8], 'sig', ARGV[9], 'stats_sig', ARGV[10])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
redis.call('SADD', KEYS[3], ARGV[1])
return 1
"""

# KEYS: w, alive, workers. ARGV: id, ttl_ms, hash_ttl_ms, stats, now, stats_sig.
# 0 when the worker is not registered or its alive key already expired: it must register again.
HEARTBEAT = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'stats', ARGV[4], 'updated', ARGV[5], 'stats_sig', ARGV[6])
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
    redis.call('DEL', key, key .. ':alive', key .. ':prefixes')
  end
end
return out
"""

# KEYS: w, alive, workers, prefixes. ARGV: id.
DEREGISTER = """
redis.call('SREM', KEYS[3], ARGV[1])
return redis.call('DEL', KEYS[1], KEYS[2], KEYS[4])
"""
