"""Every Redis key and Lua script of the service, behind one small class.

Redis is the service's only durable state: gateways are stateless and several run side by
side, so admission, claiming, fencing and the worker registry are each a single atomic
Lua script (or a single read). The keys, the request states, the scripts and their limits
are documented in ``splitserve/state/scripts.py``, beside the scripts themselves.

Time is always passed in by the caller (Unix seconds; scripts never call TIME), so scripts
are deterministic and tests drive the clock.

Errors: Redis errors are not caught here; ``redis.exceptions.ConnectionError`` and
``TimeoutError`` reach the caller (the gateway's outage policy, ``splitserve/gateway/ledger.py``).

Sync and asyncio
----------------
One class serves both kinds of client: with a ``redis.Redis`` every method returns its value;
with a ``redis.asyncio.Redis`` (``make_async_client``; the gateway and the workers' heartbeats,
which run on an event loop) every method returns an awaitable of the same value. Each method
builds its call once and decodes the reply in one function, whichever way the reply comes.
"""
from __future__ import annotations

import hashlib
import hmac
import inspect
import json
import time
import uuid
from typing import Any, Callable

from splitserve.engine.priority import priority_key
from splitserve.state import scripts
from splitserve.state.connect import make_async_client, make_client  # noqa: F401  (the clients this class takes)
from splitserve.state.records import (AdmitResult, Claimed, check_id, claimed_ids, encode_field, field_pairs,
                                      float_arg, request_fields, text, ttl_pair, worker_entries)

__all__ = [
    "AdmitResult", "Claimed", "RedisState", "make_client", "make_async_client", "queue_score",
    "TERMINAL_STATES", "PRIORITY_MIN", "PRIORITY_MAX", "ID_REUSE_AFTER_S",
]

TERMINAL_STATES = frozenset({"finished", "aborted", "failed", "deadline"})
# Seconds after its request ended before an id may name a new request: by then every gateway
# and worker that held the old one has heard of the end (the wake channel at once, a gateway's
# queued-request check within 2 s, a worker's Abort within its timeout) and let go of the id.
ID_REUSE_AFTER_S = 10

# Priority points a waiting request gains per second (splitserve.engine.priority): the default of the
# gateway's --priority-aging-per-s and of EngineConfig.priority_aging_per_s.
DEFAULT_AGING_PER_S = 1.0
# Without aging, queue_score = priority * 2**41 + arrival in ms since 2020-01-01 UTC. 2**41 ms is
# ~69.7 years (until 2089), and the whole score stays an exact integer in a double (<= 2**53).
ARRIVAL_BITS = 41
EPOCH_2020_S = 1577836800
PRIORITY_MIN = -(1 << (53 - ARRIVAL_BITS - 1))  # -2048
PRIORITY_MAX = (1 << (53 - ARRIVAL_BITS - 1)) - 1  # 2047


def _then(reply: Any, decode: Callable[[Any], Any]) -> Any:
    """``decode(reply)``, or an awaitable of it when ``reply`` is one (an asyncio client)."""
    if inspect.isawaitable(reply):
        async def awaited():
            return decode(await reply)
        return awaited()
    return decode(reply)


def queue_score(priority: int, arrival_s: float, aging_per_s: float = DEFAULT_AGING_PER_S) -> float:
    """The pending-queue score, lower first: ``splitserve.engine.priority.priority_key`` as one number.

    With aging, the virtual arrival ``arrival + priority / aging`` in ms since 2020-01-01 (so a
    waiting request's place never has to change: the order it gives is the aging rule's at every
    moment). Without aging, ``priority * 2**41 + ms since 2020-01-01``. The priority is clamped to
    [PRIORITY_MIN, PRIORITY_MAX] and the arrival to [2020, 2089]; the score is exact in a double.
    """
    p = min(max(int(priority), PRIORITY_MIN), PRIORITY_MAX)
    arrival_ms = min(max(round((arrival_s - EPOCH_2020_S) * 1000), 0), (1 << ARRIVAL_BITS) - 1)
    first, _ = priority_key(p, arrival_ms / 1000, aging_per_s)
    if aging_per_s > 0:
        return round(first * 1000, 3)
    return float((p << ARRIVAL_BITS) + arrival_ms)


# The queue limit of an admission whose place was counted before (2**53: exact in Lua's doubles).
_NO_LIMIT = 2 ** 53


class RedisState:
    """The service's Redis state: request queue, request hashes with fencing, worker and gateway
    liveness. With an asyncio client every method returns an awaitable (see the module doc)."""

    def __init__(self, client, prefix: str = "ss", queue_limit: int = 256, terminal_ttl_s: int = 600,
                 claim_scan: int = 64, priority_aging_per_s: float = DEFAULT_AGING_PER_S,
                 id_reuse_after_s: int = ID_REUSE_AFTER_S, registry_key: bytes | None = None):
        """``registry_key``: the key worker records are signed with (``Security.registry_key``,
        derived from the internal token): ``register_worker``/``heartbeat`` sign with it and
        ``workers()`` trusts only records it verifies. None: records are neither signed nor
        checked, and whoever can write to Redis can register a worker."""
        if not prefix or any(c in prefix for c in "{}"):
            raise ValueError(f"prefix must be non-empty and free of braces, got {prefix!r}")
        if queue_limit < 0:
            raise ValueError(f"queue_limit must be >= 0, got {queue_limit}")
        if terminal_ttl_s < 1:
            raise ValueError(f"terminal_ttl_s must be >= 1, got {terminal_ttl_s}")
        if claim_scan < 1:
            raise ValueError(f"claim_scan must be >= 1, got {claim_scan}")
        if not 0 <= id_reuse_after_s < terminal_ttl_s:
            raise ValueError(f"id_reuse_after_s must be in [0, terminal_ttl_s ({terminal_ttl_s})), "
                             f"got {id_reuse_after_s}")
        if not priority_aging_per_s >= 0:
            raise ValueError(f"priority_aging_per_s must be >= 0, got {priority_aging_per_s}")
        self.client = client
        self.prefix = prefix
        self.queue_limit = int(queue_limit)
        self.terminal_ttl_s = int(terminal_ttl_s)
        self.id_reuse_after_s = int(id_reuse_after_s)
        self.claim_scan = int(claim_scan)
        self.priority_aging_per_s = float(priority_aging_per_s)
        self.registry_key = registry_key or None
        tag = "{" + prefix + "}"
        self.pending_key = f"{tag}:q:pending"
        self.inflight_key = f"{tag}:q:inflight"
        self.placing_key = f"{tag}:q:placing"
        self.workers_key = f"{tag}:workers"
        # Pub/sub channel (not a key; it carries the tag so a cluster routes the scripts that
        # publish on it with their keys): "admit", "placed", "requeue", "end <request id>".
        self.wake_channel = f"{tag}:wake"
        self._req_prefix = f"{tag}:req:"
        self._w_prefix = f"{tag}:w:"
        self._gw_prefix = f"{tag}:gw:"
        reg = client.register_script
        self._admit = reg(scripts.ADMIT)
        self._claim = reg(scripts.CLAIM)
        self._placed = reg(scripts.PLACED)
        self._reap_orphans = reg(scripts.REAP_ORPHANS)
        self._gateway_beat = reg(scripts.GATEWAY_BEAT)
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
        return self._req_prefix + check_id(request_id)

    def worker_key(self, worker_id: str) -> str:
        return self._w_prefix + check_id(worker_id)

    def alive_key(self, worker_id: str) -> str:
        return self.worker_key(worker_id) + ":alive"

    def prefixes_key(self, worker_id: str) -> str:
        return self.worker_key(worker_id) + ":prefixes"

    def gateway_alive_key(self, gateway_id: str) -> str:
        return self._gw_prefix + check_id(gateway_id) + ":alive"

    # ---- requests

    def admit(self, request_id: str, gateway_id: str, priority: int, arrival_s: float, payload: dict,
              owner: str = "", room: int = 1, claim_lease_s: float | None = None, now_s: float | None = None):
        """Queue a new request atomically -> ``AdmitResult``. ``owner``: who may read and abort it
        (``splitserve.common.authz``; "" anonymous). A duplicate id (a live request's, or
        one that ended less than ``id_reuse_after_s`` ago) writes nothing and reports the existing
        state; an older terminal request's record is replaced; when fewer than ``room`` more
        requests fit under ``queue_limit`` unfinished ones (queued or in flight, over all gateways)
        it writes nothing and reports "full". ``room`` 0: the place was counted before (the later
        samples of an n > 1 request, whose first sample's admission asked room for all).

        ``claim_lease_s`` (with ``now_s``): the caller's placements take no capacity (``claim_many``
        with ``gate`` False); a request that lands at the head of the queue while no placement is
        open is then claimed in the same call, with a lease until ``now_s + claim_lease_s``
        (``AdmitResult.claimed``), as the next ``claim_many`` would have claimed it."""
        token = uuid.uuid4().hex  # same for redis-py's own retries of this call
        if claim_lease_s is not None and now_s is None:
            raise ValueError("claim_lease_s needs now_s")
        reply = self._admit(
            keys=[self.request_key(request_id), self.pending_key, self.inflight_key, self.wake_channel,
                  self.placing_key],
            args=[request_id, check_id(gateway_id), int(priority), float_arg(arrival_s),
                  queue_score(priority, arrival_s, self.priority_aging_per_s),
                  json.dumps(payload, separators=(",", ":")),
                  self.queue_limit - room + 1 if room > 0 else _NO_LIMIT, token,
                  self.terminal_ttl_s, self.id_reuse_after_s, owner,
                  "" if claim_lease_s is None else float_arg(now_s + claim_lease_s),
                  float_arg(now_s if now_s is not None else 0.0)])
        return _then(reply, lambda r: AdmitResult(text(r[0]), int(r[1]), text(r[2]) if r[2] else None,
                                                  Claimed(request_id, int(r[3]), int(r[4])) if len(r) > 3 else None))

    def claim(self, gateway_id: str, lease_s: float, now_s: float, place_s: float = 5.0):
        """Take the head of the global queue if ``gateway_id`` admitted it -> ``Claimed`` or None.

        The request moves to the in-flight set with a lease until ``now_s + lease_s``, state
        ``dispatching``, attempt and epoch +1, and holds the placement gate until ``placed`` (or
        ``requeue``/``finish``), at most ``place_s``: no one claims while a request is being
        placed, so requests take free capacity in queue order. None while another live
        gateway's request is at the head (it claims it), while a placement is open, or when the
        queue is empty. Requests of gateways that are no longer alive are failed on the way."""
        claimed = self.claim_many(gateway_id, lease_s, now_s, place_s, limit=1, gate=True)
        return _then(claimed, lambda c: c[0] if c else None)

    def claim_many(self, gateway_id: str, lease_s: float, now_s: float, place_s: float = 5.0,
                   limit: int = 1, gate: bool = True):
        """``claim``, of up to ``limit`` consecutive heads of ``gateway_id`` when ``gate`` is False
        (placements that take no capacity: a colocated worker queues the request itself, in the
        same order); one, holding the placement gate, when True. -> list of ``Claimed``."""
        reply = self._claim(
            keys=[self.pending_key, self.inflight_key, self.placing_key, self.wake_channel],
            args=[check_id(gateway_id), float_arg(now_s + lease_s), self.claim_scan, self._req_prefix,
                  self._gw_prefix, float_arg(now_s), float_arg(now_s + place_s), self.terminal_ttl_s,
                  int(limit), "1" if gate else "0"])
        return _then(reply, claimed_ids)

    def placed(self, request_id: str):
        """The claimed request has its workers: release the placement gate (and wake claimers)."""
        return _then(self._placed(keys=[self.placing_key, self.wake_channel], args=[request_id]), bool)

    def gateway_beat(self, gateway_id: str, ttl_s: float):
        """Gateway ``gateway_id`` is alive for ``ttl_s`` more seconds (its queued requests stay)."""
        return _then(self._gateway_beat(keys=[self.gateway_alive_key(gateway_id)], args=[ttl_pair(ttl_s)[0]]), bool)

    def gateway_leave(self, gateway_id: str):
        """Gateway ``gateway_id`` stops: its queued requests fail at the next claim."""
        return _then(self.client.delete(self.gateway_alive_key(gateway_id)), bool)

    def fail_orphans(self):
        """Fail every queued request whose admitting gateway is no longer alive (its client stream
        died with it), wherever it stands in the queue, freeing its room -> how many. Looks at
        the first ``max(1024, 2 * queue_limit)`` queued ids (the queue holds at most about
        ``queue_limit``)."""
        scan = max(1024, 2 * self.queue_limit)
        return _then(self._reap_orphans(keys=[self.pending_key, self.wake_channel],
                                        args=[self._req_prefix, self._gw_prefix, self.terminal_ttl_s, scan]), int)

    def requeue(self, request_id: str, epoch: int | None = None, now_s: float | None = None):
        """Put a claimed request back in the pending queue with its original score (no
        worker had room, or the reaper retries it). With ``epoch``, only that attempt; with
        ``now_s``, only if its lease deadline has passed by then (the reaper's atomic check).
        True if the request is queued afterwards. Does not check queue_limit."""
        reply = self._requeue(keys=[self.request_key(request_id), self.pending_key, self.inflight_key,
                                    self.placing_key, self.wake_channel],
                              args=[request_id, "" if epoch is None else int(epoch),
                                    "" if now_s is None else float_arg(now_s)])
        return _then(reply, bool)

    def update(self, request_id: str, epoch: int, **fields: Any):
        """Write fields of a claimed request. False (nothing written) when ``epoch`` is not
        the current one (a stale attempt), or the request is queued, terminal or unknown.
        ``state`` may be written, but not ``queued`` (use requeue) nor a terminal state (use
        finish). dict/list values are stored as JSON."""
        state = fields.get("state")
        if state is not None and (state == "queued" or state in TERMINAL_STATES):
            raise ValueError(f"update cannot set state {state!r}; use requeue or finish")
        return _then(self._update(keys=[self.request_key(request_id)], args=[int(epoch), *field_pairs(fields)]), bool)

    def extend_lease(self, request_id: str, epoch: int, lease_s: float, now_s: float):
        """Move the lease deadline to ``now_s + lease_s``; False if the epoch is stale or the
        request is no longer in flight."""
        return _then(self._extend(keys=[self.request_key(request_id), self.inflight_key],
                                  args=[request_id, int(epoch), float_arg(now_s + lease_s)]), bool)

    def finish(self, request_id: str, epoch: int | None, state: str, **fields: Any):
        """Terminal step: leave every queue, write ``state`` and fields, expire the hash after
        ``terminal_ttl_s``. ``epoch=None`` skips the fencing check (the gateway aborting).
        Idempotent: True if the request is in ``state`` afterwards (by this call or an earlier
        one); False if refused (stale epoch, unknown id, or already in another terminal state)."""
        if state not in TERMINAL_STATES:
            raise ValueError(f"finish needs a terminal state {sorted(TERMINAL_STATES)}, got {state!r}")
        reply = self._finish(keys=[self.request_key(request_id), self.pending_key, self.inflight_key,
                                   self.placing_key, self.wake_channel],
                             args=[request_id, "" if epoch is None else int(epoch), state,
                                   self.terminal_ttl_s, *field_pairs(fields)])
        return _then(reply, bool)

    def cancel_pending(self, request_id: str, reason: str = "cancelled before dispatch", owner: str | None = None):
        """A queued request whose client went away: out of the queue, state ``aborted``.
        True if it is aborted afterwards; False if it was already claimed (cancel it on its
        workers instead), is in another terminal state, or is unknown. With ``owner``, only a
        request of that owner (checked in the same atomic step); None: any."""
        return _then(self._cancel(keys=[self.request_key(request_id), self.pending_key, self.wake_channel],
                                  args=[request_id, self.terminal_ttl_s, reason, "0" if owner is None else "1",
                                        owner or ""]), bool)

    def get(self, request_id: str):
        """The request's fields (ints: attempt, epoch, priority; floats: arrival, score;
        payload as a dict), or None if unknown or expired."""
        return _then(self.client.hgetall(self.request_key(request_id)), request_fields)

    def states(self, request_ids: list[str]):
        """The state of each request (None where unknown or expired), in one round trip."""
        if not request_ids:
            return _then([], list)
        keys = [self.request_key(r) for r in request_ids]
        return _then(self.client.eval("local out = {} for i, k in ipairs(KEYS) do "
                                      "out[i] = redis.call('HGET', k, 'state') end return out",
                                      len(keys), *keys), lambda r: [text(x) if x else None for x in r])

    def queue_depth(self):
        """Requests in state queued."""
        return _then(self.client.zcard(self.pending_key), int)

    def pending_ids(self, limit: int = 64):
        """The first ``limit`` queued ids, in queue order."""
        return _then(self.client.zrange(self.pending_key, 0, limit - 1), lambda r: [text(x) for x in r])

    def inflight_expired(self, now_s: float, limit: int | None = None):
        """Claimed requests whose lease deadline is before ``now_s``, oldest deadline first."""
        kw = {} if limit is None else {"start": 0, "num": limit}
        return _then(self.client.zrangebyscore(self.inflight_key, "-inf", "(" + float_arg(now_s), **kw),
                     lambda r: [text(x) for x in r])

    # ---- workers

    def register_worker(self, worker_id: str, role: str, address: str, transports: list[str],
                        stats: dict, ttl_s: float):
        """(Re)register a worker: a fresh hash and an alive key that lives ``ttl_s``; signed
        with ``registry_key`` when there is one."""
        ttl_ms, hash_ttl_ms = ttl_pair(ttl_s)
        transports_json, stats_json = json.dumps(list(transports)), json.dumps(stats)
        return _then(self._register(keys=[self.worker_key(worker_id), self.alive_key(worker_id), self.workers_key],
                                    args=[worker_id, ttl_ms, hash_ttl_ms, role, address, transports_json, stats_json,
                                          float_arg(time.time()),
                                          self._sign("record", worker_id, role, address, transports_json),
                                          self._sign("stats", worker_id, stats_json)]), lambda _: None)

    def heartbeat(self, worker_id: str, stats: dict, ttl_s: float):
        """Refresh stats (signed anew) and the alive key. False if the worker is unknown or its
        alive key already expired (it was presumed dead and must ``register_worker`` again)."""
        ttl_ms, hash_ttl_ms = ttl_pair(ttl_s)
        stats_json = json.dumps(stats)
        return _then(self._heartbeat(keys=[self.worker_key(worker_id), self.alive_key(worker_id), self.workers_key],
                                     args=[worker_id, ttl_ms, hash_ttl_ms, stats_json, float_arg(time.time()),
                                           self._sign("stats", worker_id, stats_json)]), bool)

    def workers(self):
        """Live workers, by id: dicts with worker_id, role, address, transports (list), stats (dict),
        updated (float) and trusted (bool: there is no ``registry_key``, or the record's
        signatures verify with it; a record written by anyone without the key is not). Dead
        workers are pruned from the registry on the way."""
        return _then(self._workers(keys=[self.workers_key], args=[self._w_prefix]),
                     lambda flat: worker_entries(flat, self._trusted))

    def _sign(self, kind: str, *fields: str) -> str:
        """The signature of a worker record's ``fields`` (``""`` without a key). Two of them: the
        record's identity (where requests go: id, role, address, transports), written once at
        registration, and its stats (load, host id, metrics address), written on every beat.
        ``kind`` keeps one from passing for the other; a JSON list keeps field bounds unambiguous."""
        if self.registry_key is None:
            return ""
        message = json.dumps([kind, *fields], separators=(",", ":")).encode()
        return hmac.new(self.registry_key, message, hashlib.sha256).hexdigest()

    def _trusted(self, worker_id: str, d: dict[str, str]) -> bool:
        if self.registry_key is None:
            return True
        expected = (self._sign("record", worker_id, d.get("role", ""), d.get("address", ""), d.get("transports", "[]"))
                    + self._sign("stats", worker_id, d.get("stats", "{}")))
        return hmac.compare_digest(expected, d.get("sig", "") + d.get("stats_sig", ""))

    def deregister(self, worker_id: str):
        return _then(self._deregister(keys=[self.worker_key(worker_id), self.alive_key(worker_id),
                                            self.workers_key, self.prefixes_key(worker_id)], args=[worker_id]),
                     lambda _: None)

    # ---- health

    def ping(self):
        return _then(self.client.ping(), bool)


