"""Every Redis key and Lua script of the service, behind one small class.

Redis is the service's only durable state: gateways are stateless and several run side by
side, so admission, claiming, fencing and the worker registry are each a single atomic
Lua script (or a single read).

Keys
----
Every key starts with the hash tag ``{<prefix>}`` (default ``{ss}``), so all of them hash
to one slot and the multi-key scripts also run on Redis Cluster (the whole service state
then lives on one shard).

============================  ======  ======================================================
key                           type    holds
============================  ======  ======================================================
``{ss}:q:pending``            ZSET    ids of requests in state ``queued``; score =
                                      ``queue_score(priority, arrival)`` (lower first: by
                                      priority, then by arrival). ZCARD is the queue depth;
                                      ``queue_limit`` caps it plus the in-flight ZCARD.
``{ss}:q:inflight``           ZSET    ids of claimed requests (any non-terminal state after
                                      ``queued``); score = lease deadline, Unix seconds.
``{ss}:req:<request id>``     HASH    ``state``, ``priority``, ``gateway`` (the admitting
                                      gateway), ``arrival`` (Unix s), ``score``, ``attempt``
                                      and ``epoch`` (both +1 per claim; the epoch fences
                                      writes of stale attempts), ``payload`` (JSON object),
                                      ``admit_token`` (makes a retried admit call idempotent)
                                      and whatever ``update``/``finish`` write (worker ids,
                                      timings, ``error``...). No TTL while live; EXPIRE
                                      ``terminal_ttl_s`` once terminal.
``{ss}:workers``              SET     ids of registered workers (dead ones are pruned by
                                      ``workers()``).
``{ss}:w:<worker id>``        HASH    ``role``, ``address``, ``transports`` (JSON list),
                                      ``stats`` (JSON object: free pages, load...),
                                      ``updated`` (Unix s). PEXPIRE of 10 heartbeat TTLs, so
                                      it never outlives a dead worker for long.
``{ss}:w:<worker id>:alive``  STRING  ``1`` with PX = the heartbeat TTL: the worker is alive
                                      exactly while this key exists.
============================  ======  ======================================================

The request's page lease (``kv:lease:<id>`` in ARCHITECTURE.md) is not a key of its own in
this design: the lease deadline is the request's score in ``q:inflight`` and the fencing
token is its ``epoch``. A new key must be added to this table and carry the hash tag.

Request states: ``queued`` -> ``dispatching`` (set by ``claim``) -> any states the caller
writes with ``update`` (``prefilling``, ``decoding``...) -> one terminal state of
``TERMINAL_STATES``. ``requeue`` goes back to ``queued``.

Scripts
-------
``ADMIT``       duplicate check, capacity check (pending + in flight < queue_limit), HSET + ZADD.
``CLAIM``       first of the first ``claim_scan`` pending ids (score order) admitted by this
                gateway -> inflight with a lease; ``attempt`` and ``epoch`` +1.
``REQUEUE``     inflight -> pending with the request's original score, state ``queued``.
``UPDATE``      HSET fields iff the epoch matches and the request is claimed, not terminal.
``EXTEND``      move the lease deadline iff the epoch matches.
``FINISH``      terminal state: out of both queues, fields written, EXPIRE.
``CANCEL``      a still-queued request leaves the queue as ``aborted``.
``REGISTER`` / ``HEARTBEAT`` / ``WORKERS`` / ``DEREGISTER``: the worker registry.

Time is always passed in by the caller (Unix seconds; scripts never call TIME), so scripts
are deterministic and tests drive the clock.

Limitations
-----------
* ``claim`` looks at the first ``claim_scan`` (64) pending ids only and takes the first one
  admitted by the calling gateway: each gateway dispatches what it admitted, because it
  holds that client's stream. If more than ``claim_scan`` requests of other gateways are
  ahead, a gateway sees nothing to claim until they move. A request admitted by a gateway
  that died stays queued until someone ``cancel_pending``\\s it.
* Aging (so low priority cannot starve) is the dispatcher's job: the pending score is
  static. ``pending_ids`` and ``claim(..., request_id=...)`` let a dispatcher pick.
* Priorities are clamped to ``[PRIORITY_MIN, PRIORITY_MAX]`` in the score (the stored
  ``priority`` field keeps the real value); arrivals before 2020-01-01 count as 2020-01-01,
  so ``arrival_s`` must be Unix time for arrival order to hold.
* The duplicate check lasts as long as the request hash: a terminal request's id can be
  admitted again once its hash has expired (``terminal_ttl_s``).
* A ``claim`` whose reply is lost (socket timeout after the server ran it) leaves that
  request claimed until its lease expires and the reaper requeues it.

Errors: Redis errors are not caught here; ``redis.exceptions.ConnectionError`` and
``TimeoutError`` reach the caller, which maps them to UNAVAILABLE.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from gateway import redis_scripts as scripts

__all__ = [
    "AdmitResult", "Claimed", "RedisState", "make_client", "queue_score",
    "TERMINAL_STATES", "PRIORITY_MIN", "PRIORITY_MAX",
]

TERMINAL_STATES = frozenset({"finished", "aborted", "failed", "deadline"})

# queue_score = priority * 2**41 + arrival in ms since 2020-01-01 UTC. 2**41 ms is ~69.7 years
# (until 2089), and the whole score stays an exact integer in a double (|score| <= 2**53).
ARRIVAL_BITS = 41
EPOCH_2020_S = 1577836800
PRIORITY_MIN = -(1 << (53 - ARRIVAL_BITS - 1))  # -2048
PRIORITY_MAX = (1 << (53 - ARRIVAL_BITS - 1)) - 1  # 2047

# Fields owned by the scripts; update()/finish() may not write them.
_RESERVED_FIELDS = frozenset({"epoch", "attempt", "gateway", "priority", "arrival", "score",
                              "payload", "admit_token"})
_INT_FIELDS = ("attempt", "epoch", "priority")
_FLOAT_FIELDS = ("arrival", "score")

def make_client(url: str, password: str | None = None) -> redis.Redis:
    """A client with bounded waits: 2 s socket and connect timeouts, a PING before reusing a
    connection idle for 5 s, and one quick retry (a pooled connection broken by a Redis
    restart reconnects) instead of redis-py's default ten."""
    kwargs: dict[str, Any] = dict(socket_timeout=2, socket_connect_timeout=2, health_check_interval=5,
                                  decode_responses=True,
                                  retry=Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.1), retries=1))
    if password is not None:
        kwargs["password"] = password
    return redis.Redis.from_url(url, **kwargs)


def queue_score(priority: int, arrival_s: float) -> int:
    """The pending-queue score: lower priority value first, ties by arrival (ms resolution).

    ``priority * 2**41 + ms since 2020-01-01``, with the priority clamped to
    [PRIORITY_MIN, PRIORITY_MAX] and the arrival to [2020, 2089]: an exact integer in a double.
    """
    p = min(max(int(priority), PRIORITY_MIN), PRIORITY_MAX)
    ms = min(max(round((arrival_s - EPOCH_2020_S) * 1000), 0), (1 << ARRIVAL_BITS) - 1)
    return (p << ARRIVAL_BITS) + ms


@dataclass(frozen=True)
class AdmitResult:
    """``status``: "admitted", "duplicate" (the id exists: nothing was written) or "full".
    ``depth``: the pending-queue depth after the call. ``state``: the request's state
    ("queued" when admitted, the existing request's state when a duplicate, None when full)."""
    status: Literal["admitted", "duplicate", "full"]
    depth: int
    state: str | None = None

    @property
    def admitted(self) -> bool:
        return self.status == "admitted"

    @property
    def detail(self) -> str | int | None:
        """The existing request's state for a duplicate, else the queue depth."""
        return self.state if self.status == "duplicate" else self.depth


class Claimed(str):
    """A claimed request id (a plain ``str``) that also carries the claim's ``epoch`` (the
    fencing token for ``update``/``extend_lease``/``finish``) and ``attempt``."""
    epoch: int
    attempt: int

    def __new__(cls, request_id: str, epoch: int, attempt: int) -> "Claimed":
        obj = super().__new__(cls, request_id)
        obj.epoch = epoch
        obj.attempt = attempt
        return obj


def _s(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def _encode(value: Any) -> Any:
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, (bool, type(None))):
        raise TypeError(f"cannot store {value!r} in a Redis hash field")
    return value


def _float_arg(value: float) -> str:
    return repr(float(value))


class RedisState:
    """The service's Redis state: request queue, request hashes with fencing, worker registry."""

    def __init__(self, client: redis.Redis, prefix: str = "ss", queue_limit: int = 256,
                 terminal_ttl_s: int = 600, claim_scan: int = 64):
        if not prefix or any(c in prefix for c in "{}"):
            raise ValueError(f"prefix must be non-empty and free of braces, got {prefix!r}")
        if queue_limit < 0:
            raise ValueError(f"queue_limit must be >= 0, got {queue_limit}")
        if terminal_ttl_s < 1:
            raise ValueError(f"terminal_ttl_s must be >= 1, got {terminal_ttl_s}")
        if claim_scan < 1:
            raise ValueError(f"claim_scan must be >= 1, got {claim_scan}")
        self.client = client
        self.prefix = prefix
        self.queue_limit = int(queue_limit)
        self.terminal_ttl_s = int(terminal_ttl_s)
        self.claim_scan = int(claim_scan)
        tag = "{" + prefix + "}"
        self.pending_key = f"{tag}:q:pending"
        self.inflight_key = f"{tag}:q:inflight"
        self.workers_key = f"{tag}:workers"
        self._req_prefix = f"{tag}:req:"
        self._w_prefix = f"{tag}:w:"
        reg = client.register_script
        self._admit = reg(scripts.ADMIT)
        self._claim = reg(scripts.CLAIM)
        self._requeue = reg(scripts.REQUEUE)
        self._update = reg(scripts.UPDATE)
        self._extend = reg(scripts.EXTEND)
        self._finish = reg(scripts.FINISH)
        self._cancel = reg(scripts.CANCEL)
        self._register = reg(scripts.REGISTER)
        self._heartbeat = reg(scripts.HEARTBEAT)
        self._workers = reg(scripts.WORKERS)
        self._deregister = reg(scripts.DEREGISTER)

    # ---- keys

    def request_key(self, request_id: str) -> str:
        return self._req_prefix + _check_id(request_id)

    def worker_key(self, worker_id: str) -> str:
        return self._w_prefix + _check_id(worker_id)

    def alive_key(self, worker_id: str) -> str:
        return self.worker_key(worker_id) + ":alive"

    # ---- requests

    def admit(self, request_id: str, gateway_id: str, priority: int, arrival_s: float,
              payload: dict) -> AdmitResult:
        """Queue a new request atomically: a duplicate id writes nothing and reports the
        existing state; when ``queue_limit`` requests are unfinished (queued or in flight, over all
        gateways) it writes nothing and reports "full"."""
        token = uuid.uuid4().hex  # same for redis-py's own retries of this call
        status, depth, state = self._admit(
            keys=[self.request_key(request_id), self.pending_key, self.inflight_key],
            args=[request_id, _check_id(gateway_id), int(priority), _float_arg(arrival_s),
                  queue_score(priority, arrival_s), json.dumps(payload, separators=(",", ":")),
                  self.queue_limit, token])
        return AdmitResult(_s(status), int(depth), _s(state) if state else None)

    def claim(self, gateway_id: str, lease_s: float, now_s: float,
              request_id: str | None = None) -> Claimed | None:
        """Take the best queued request admitted by ``gateway_id`` (or exactly ``request_id``
        if given and still queued by this gateway): it moves to the in-flight set with a lease
        until ``now_s + lease_s``, state ``dispatching``, attempt and epoch +1. None if none."""
        res = self._claim(keys=[self.pending_key, self.inflight_key],
                          args=[_check_id(gateway_id), _float_arg(now_s + lease_s), self.claim_scan,
                                self._req_prefix, "" if request_id is None else _check_id(request_id)])
        if not res:
            return None
        return Claimed(_s(res[0]), int(res[1]), int(res[2]))

    def requeue(self, request_id: str, epoch: int | None = None, now_s: float | None = None) -> bool:
        """Put a claimed request back in the pending queue with its original score (no
        worker had room, or the reaper retries it). With ``epoch``, only that attempt; with
        ``now_s``, only if its lease deadline has passed by then (the reaper's atomic check).
        True if the request is queued afterwards. Does not check queue_limit."""
        return bool(self._requeue(keys=[self.request_key(request_id), self.pending_key, self.inflight_key],
                                  args=[request_id, "" if epoch is None else int(epoch),
                                        "" if now_s is None else _float_arg(now_s)]))

    def update(self, request_id: str, epoch: int, **fields: Any) -> bool:
        """Write fields of a claimed request. False (nothing written) when ``epoch`` is not
        the current one (a stale attempt), or the request is queued, terminal or unknown.
        ``state`` may be written, but not ``queued`` (use requeue) nor a terminal state (use
        finish). dict/list values are stored as JSON."""
        state = fields.get("state")
        if state is not None and (state == "queued" or state in TERMINAL_STATES):
            raise ValueError(f"update cannot set state {state!r}; use requeue or finish")
        args = [int(epoch), *_pairs(fields)]
        return bool(self._update(keys=[self.request_key(request_id)], args=args))

    def extend_lease(self, request_id: str, epoch: int, lease_s: float, now_s: float) -> bool:
        """Move the lease deadline to ``now_s + lease_s``; False if the epoch is stale or the
        request is no longer in flight."""
        return bool(self._extend(keys=[self.request_key(request_id), self.inflight_key],
                                 args=[request_id, int(epoch), _float_arg(now_s + lease_s)]))

    def finish(self, request_id: str, epoch: int | None, state: str, **fields: Any) -> bool:
        """Terminal step: leave both queues, write ``state`` and fields, expire the hash after
        ``terminal_ttl_s``. ``epoch=None`` skips the fencing check (the gateway aborting).
        Idempotent: True if the request is in ``state`` afterwards (by this call or an earlier
        one); False if refused (stale epoch, unknown id, or already in another terminal state)."""
        if state not in TERMINAL_STATES:
            raise ValueError(f"finish needs a terminal state {sorted(TERMINAL_STATES)}, got {state!r}")
        return bool(self._finish(keys=[self.request_key(request_id), self.pending_key, self.inflight_key],
                                 args=[request_id, "" if epoch is None else int(epoch), state,
                                       self.terminal_ttl_s, *_pairs(fields)]))

    def cancel_pending(self, request_id: str, reason: str = "cancelled before dispatch") -> bool:
        """A queued request whose client went away: out of the queue, state ``aborted``.
        True if it is aborted afterwards; False if it was already claimed (cancel it on its
        workers instead), is in another terminal state, or is unknown."""
        return bool(self._cancel(keys=[self.request_key(request_id), self.pending_key],
                                 args=[request_id, self.terminal_ttl_s, reason]))

    def get(self, request_id: str) -> dict[str, Any] | None:
        """The request's fields (ints: attempt, epoch, priority; floats: arrival, score;
        payload as a dict), or None if unknown or expired."""
        raw = self.client.hgetall(self.request_key(request_id))
        if not raw:
            return None
        out = {_s(k): _s(v) for k, v in raw.items()}
        out.pop("admit_token", None)
        for k in _INT_FIELDS:
            if k in out:
                out[k] = int(out[k])
        for k in _FLOAT_FIELDS:
            if k in out:
                out[k] = float(out[k])
        if "payload" in out:
            out["payload"] = json.loads(out["payload"])
        return out

    def queue_depth(self) -> int:
        """Requests in state queued."""
        return int(self.client.zcard(self.pending_key))

    def pending_ids(self, limit: int = 64) -> list[str]:
        """The first ``limit`` queued ids in queue order (for a dispatcher that ages)."""
        return [_s(x) for x in self.client.zrange(self.pending_key, 0, limit - 1)]

    def inflight_expired(self, now_s: float, limit: int | None = None) -> list[str]:
        """Claimed requests whose lease deadline is before ``now_s``, oldest deadline first."""
        kw = {} if limit is None else {"start": 0, "num": limit}
        return [_s(x) for x in self.client.zrangebyscore(self.inflight_key, "-inf",
                                                         "(" + _float_arg(now_s), **kw)]

    # ---- workers

    def register_worker(self, worker_id: str, role: str, address: str, transports: list[str],
                        stats: dict, ttl_s: float) -> None:
        """(Re)register a worker: a fresh hash and an alive key that lives ``ttl_s``."""
        ttl_ms, hash_ttl_ms = _ttls(ttl_s)
        self._register(keys=[self.worker_key(worker_id), self.alive_key(worker_id), self.workers_key],
                       args=[worker_id, ttl_ms, hash_ttl_ms, role, address, json.dumps(list(transports)),
                             json.dumps(stats), _float_arg(time.time())])

    def heartbeat(self, worker_id: str, stats: dict, ttl_s: float) -> bool:
        """Refresh stats and the alive key. False if the worker is unknown or its alive key
        already expired (it was presumed dead and must ``register_worker`` again)."""
        ttl_ms, hash_ttl_ms = _ttls(ttl_s)
        return bool(self._heartbeat(keys=[self.worker_key(worker_id), self.alive_key(worker_id), self.workers_key],
                                    args=[worker_id, ttl_ms, hash_ttl_ms, json.dumps(stats),
                                          _float_arg(time.time())]))

    def workers(self) -> list[dict[str, Any]]:
        """Live workers, by id: dicts with worker_id, role, address, transports (list), stats (dict),
        updated (float). Dead workers are pruned from the registry on the way."""
        flat = self._workers(keys=[self.workers_key], args=[self._w_prefix])
        out = []
        for i in range(0, len(flat), 2):
            fields = flat[i + 1]
            d = {_s(fields[j]): _s(fields[j + 1]) for j in range(0, len(fields), 2)}
            out.append({"worker_id": _s(flat[i]), "role": d.get("role", ""), "address": d.get("address", ""),
                        "transports": json.loads(d.get("transports", "[]")),
                        "stats": json.loads(d.get("stats", "{}")),
                        "updated": float(d.get("updated", 0.0))})
        out.sort(key=lambda w: w["worker_id"])
        return out

    def deregister(self, worker_id: str) -> None:
        self._deregister(keys=[self.worker_key(worker_id), self.alive_key(worker_id), self.workers_key],
                         args=[worker_id])

    # ---- health

    def ping(self) -> bool:
        return bool(self.client.ping())


def _check_id(value: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"ids must be non-empty strings, got {value!r}")
    return value


def _pairs(fields: dict[str, Any]) -> list[Any]:
    bad = _RESERVED_FIELDS.intersection(fields)
    if bad:
        raise ValueError(f"fields {sorted(bad)} are owned by the queue scripts")
    out: list[Any] = []
    for k, v in fields.items():
        out += [k, _encode(v)]
    return out


def _ttls(ttl_s: float) -> tuple[int, int]:
    ttl_ms = max(1, round(ttl_s * 1000))
    return ttl_ms, 10 * ttl_ms
