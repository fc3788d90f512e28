"""The gateway's view of the workers: who is alive (Redis heartbeats), how to reach them, whom to pick."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.common.grpc_server import WORKER_SERVICES
from splitserve.common.locality import transfer_cost
from splitserve.gateway.prefill_placement import DisaggregationPolicy, PrefillPlacement
from splitserve.gateway.prefix_routing import CachedRun, PrefixRouter
from splitserve.v1 import worker_pb2_grpc

log = logging.getLogger(__name__)

# How long a listing of the workers is reused before Redis is asked again.
REFRESH_S = 0.5
# What a decode worker's cached prefix is worth next to a prefill worker's (a colocated worker's
# counts in full): its cached head is not transferred, but the prefill worker computes it anyway.
# Under --disaggregation never it counts in full (the decode worker prefills its prompts).
DECODE_CACHE_WEIGHT = 0.25
# A live worker answers a health check within this; a frozen (SIGSTOPped) one never does.
PROBE_TIMEOUT_S = 1.0
# An untrusted registry record (not signed with the internal token) is logged once per this many
# seconds per worker id: every listing sees it again, the log must not.
UNTRUSTED_LOG_EVERY_S = 60.0


@dataclass
class WorkerView:
    worker_id: str
    role: str  # prefill | decode | both
    address: str
    transports: list[str] = field(default_factory=list)
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    num_running: int = 0
    num_waiting: int = 0
    metrics_address: str = ""
    host_id: str = ""  # its shared-memory domain (splitserve/common/locality.py); "" when it does not say
    loras: frozenset[str] = frozenset()  # the LoRA adapters it serves
    kv_tier_shared: str = ""  # the shared host KV tier it maps (--kv-offloading-shared), "" none
    step_prompt_budget: int | None = None  # prompt tokens a step takes beside its decodes (--target-tpot-ms)

    @classmethod
    def from_registry(cls, entry: dict) -> "WorkerView":
        stats = entry.get("stats") or {}
        return cls(worker_id=entry["worker_id"], role=entry["role"], address=entry["address"],
                   transports=list(entry.get("transports") or []),
                   kv_blocks_total=int(stats.get("kv_blocks_total", 0)),
                   kv_blocks_free=int(stats.get("kv_blocks_free", 0)),
                   kv_blocks_cached=int(stats.get("kv_blocks_cached", 0)),
                   num_running=int(stats.get("num_running", 0)), num_waiting=int(stats.get("num_waiting", 0)),
                   metrics_address=str(stats.get("metrics_address", "")), host_id=str(stats.get("host_id", "")),
                   loras=frozenset(str(name) for name in stats.get("loras") or ()),
                   kv_tier_shared=str(stats.get("kv_tier_shared", "")),
                   step_prompt_budget=_budget(stats.get("step_prompt_budget")))

    def serves(self, lora: str | None) -> bool:
        """It can run a request under ``lora`` (None: the base model, which every worker serves)."""
        return lora is None or lora in self.loras


class WorkerDirectory:
    """Live workers from the Redis registry (cached for ``REFRESH_S``), channels to them, and the
    gateway's picks. Runs on the gateway's event loop: ``state`` is an asyncio ``RedisState``."""

    def __init__(self, state, block_size: int = 16,
                 channel_factory: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel,
                 on_untrusted: Callable[[int], None] = lambda count: None, prefix_routing: bool = True,
                 disaggregation: DisaggregationPolicy = DisaggregationPolicy(),
                 on_prefill_placement: Callable[[PrefillPlacement], None] = lambda placement: None):
        """``channel_factory(address)`` opens a channel to a worker (``Security.aio_channel``: TLS, token);
        ``on_untrusted(count)``: how many registry records the last listing ignored (a metric);
        ``prefix_routing``: weigh where prompts' prefixes are cached (the directory in Redis)
        against load, else place by load alone; ``disaggregation``: where prompts placed on a
        decode worker are prefilled (splitserve/gateway/prefill_placement.py), each decision
        told to ``on_prefill_placement`` (a metric)."""
        self.prefill_policy = disaggregation
        self.on_prefill_placement = on_prefill_placement
        self.state = state
        self.on_untrusted = on_untrusted
        # Untrusted worker ids -> when they may be logged again (monotonic).
        self._untrusted_logged: dict[str, float] = {}
        self.channel_factory = channel_factory
        self.block_size = block_size
        self.prefixes = PrefixRouter(state, block_size, enabled=prefix_routing)
        self._refresh = asyncio.Lock()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._cached: list[WorkerView] = []
        self._cached_at = -REFRESH_S
        # Requests this gateway has in flight per worker: fresher than heartbeats.
        self.inflight: dict[str, int] = {}
        # Prompts of this gateway prefilling on each decode worker (local prefills, before their first token).
        self.local_prefills: dict[str, int] = {}
        # Workers that just failed a request, skipped until the given monotonic time.
        self._suspects: dict[str, float] = {}

    def invalidate(self) -> None:
        """The next ``list`` reads the registry again (after a change this gateway made)."""
        self._cached_at = -REFRESH_S

    async def list(self) -> list[WorkerView]:
        """The registered workers (one Redis read per ``REFRESH_S``, however many callers)."""
        async with self._refresh:
            if time.monotonic() - self._cached_at > REFRESH_S:
                entries = await self.state.workers()
                # A record not signed with the internal token was not written by a worker of
                # this deployment (or by one with another token): no request, and so no prompt
                # and no internal token, ever goes to its address.
                self._note_untrusted([e for e in entries if not e.get("trusted", True)])
                self._cached = [WorkerView.from_registry(e) for e in entries if e.get("trusted", True)]
                self._cached_at = time.monotonic()
            return list(self._cached)

    def _note_untrusted(self, entries: list[dict]) -> None:
        self.on_untrusted(len(entries))
        now = time.monotonic()
        self._untrusted_logged = {w: t for w, t in self._untrusted_logged.items() if t > now}
        for e in entries:
            if e["worker_id"] in self._untrusted_logged:
                continue
            self._untrusted_logged[e["worker_id"]] = now + UNTRUSTED_LOG_EVERY_S
            log.warning("ignoring worker %r (%r at %r) in the Redis registry: its record is not signed with this "
                        "gateway's --internal-token (a worker with another token, or someone writing to Redis)",
                        e["worker_id"], e.get("role", ""), e.get("address", ""))

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = self.channel_factory(address)
        return self._channels[address]

    def decode_stub(self, worker: WorkerView) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self.channel(worker.address))

    def prefill_stub(self, worker: WorkerView) -> worker_pb2_grpc.PrefillWorkerStub:
        return worker_pb2_grpc.PrefillWorkerStub(self.channel(worker.address))

    async def usable(self) -> list[WorkerView]:
        """Registered workers not suspected of having died."""
        now = time.monotonic()
        self._suspects = {w: t for w, t in self._suspects.items() if t > now}
        return [w for w in await self.list() if w.worker_id not in self._suspects]

    def suspect(self, worker_id: str, seconds: float) -> None:
        """Pick ``worker_id`` for nothing for ``seconds`` (it failed a request and a probe, or a Reserve)."""
        self._suspects[worker_id] = time.monotonic() + seconds

    async def probe(self, worker: WorkerView) -> bool | None:
        """Ask the worker itself: True serving, False alive but not serving (draining, engine
        dead), None no answer (dead, frozen or unreachable). The question is the worker's
        readiness (its own service's health): a draining worker is alive but takes nothing new."""
        try:
            reply = await health_pb2_grpc.HealthStub(self.channel(worker.address)).Check(
                health_pb2.HealthCheckRequest(service=WORKER_SERVICES.get(worker.role, "")), timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError:
            return None
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def responsive(self, worker: WorkerView) -> bool:
        return bool(await self.probe(worker))

    def path_cost(self, prefill: WorkerView, decode: WorkerView) -> float:
        """What KV from ``prefill`` to ``decode`` costs, in requests of load (splitserve/common/locality.py):
        nothing on one host over shm or cuda_ipc, more over the network."""
        return transfer_cost(prefill.transports, prefill.host_id, decode.transports, decode.host_id)

    async def decode_candidates(self, lora: str | None = None,
                                prompt_token_ids: Sequence[int] = ()) -> list[WorkerView]:
        """``placement_candidates`` without the cached runs."""
        return (await self.placement_candidates(lora, prompt_token_ids))[0]

    async def placement_candidates(self, lora: str | None = None, prompt_token_ids: Sequence[int] = ()
                                   ) -> tuple[list[WorkerView], dict[str, CachedRun]]:
        """Decode-capable workers, best first, and the prompt's leading run on each that caches
        any: fewest requests in flight from this gateway
        (counted from the moment a reservation is asked for, so a burst spreads out) plus how much
        worse than the best route in the stack its cheapest route from a prefill worker is (that
        prefill worker's load plus the transfer's cost), less what the prompt's prefix cached
        there is worth (``prefix_routing``: in full on a colocated worker, which skips its
        prefill; ``DECODE_CACHE_WEIGHT`` of it on a decode worker, which skips its transfer); then
        fewest running and waiting as last heartbeated, then most free KV pages. Where every route
        costs the same and nothing is cached, this is the order by load alone. ``lora``: only
        workers serving it."""
        usable = [w for w in await self.usable() if w.serves(lora)]
        workers = [w for w in usable if w.role in ("decode", "both")]
        prefills = [w for w in usable if w.role == "prefill"]
        route = {w.worker_id: min((self.inflight.get(p.worker_id, 0) + self.path_cost(p, w) for p in prefills),
                                  default=0.0)
                 for w in workers if w.role == "decode"}
        best = min(route.values(), default=0.0)
        # A colocated worker moves no KV: its route is as good as the best one.
        extra = lambda w: route[w.worker_id] - best if w.role == "decode" else 0.0  # noqa: E731
        # One worker: there is nothing to choose, so no Redis round trip (1.5 ms of a request's
        # time to its first token on a loaded 2-core box) where its cached run says nothing more:
        # a colocated worker, or a decode worker whose prompts all go to prefill workers
        # (--disaggregation always; the Reserve then says what it holds). Elsewhere the run
        # decides, or reports, what the decode worker computes.
        alone = len(workers) == 1 and (workers[0].role == "both" or self.prefill_policy.disaggregation == "always")
        cached = {} if alone else await self.prefixes.lookup([w.worker_id for w in workers], prompt_token_ids, lora,
                                                              _shared(workers))
        decode_weight = 1.0 if self.prefill_policy.disaggregation == "never" else DECODE_CACHE_WEIGHT
        credit = {w.worker_id: cached[w.worker_id].credit(self.block_size) * (decode_weight if w.role == "decode"
                                                                              else 1.0)
                  for w in workers if w.worker_id in cached}
        ordered = sorted(workers, key=lambda w: (self.inflight.get(w.worker_id, 0) + extra(w)
                                                 - credit.get(w.worker_id, 0), w.num_running + w.num_waiting,
                                                 -w.kv_blocks_free))
        return ordered, cached

    async def prefill_queue(self, decode: WorkerView, lora: str | None = None) -> float | None:
        """Requests ahead on the cheapest route from a prefill worker to ``decode``: what the
        worker has in flight (this gateway's count, or its last heartbeat's running and waiting
        when that says more: other gateways' requests) plus the transfer's cost; None when no
        prefill worker serves ``lora``."""
        prefills = [w for w in await self.usable() if w.role == "prefill" and w.serves(lora)]
        return min((max(self.inflight.get(p.worker_id, 0), p.num_running + p.num_waiting) + self.path_cost(p, decode)
                    for p in prefills), default=None)

    async def pick_prefill(self, prompt_token_ids: Sequence[int] = (), decode: WorkerView | None = None,
                           lora: str | None = None) -> WorkerView | None:
        """The prefill worker serving ``lora`` with the least load (requests this gateway has in
        flight there; with ``decode``, plus the transfer to it, ``path_cost``) less what the prompt's
        prefix cached there is worth (``prefix_routing``); then the fewest running and waiting as
        last heartbeated."""
        workers = [w for w in await self.usable() if w.role == "prefill" and w.serves(lora)]
        if not workers:
            return None
        if len(workers) == 1:  # nothing to choose: no lookup (a Redis round trip before the prefill)
            return workers[0]
        cost = (lambda w: self.path_cost(w, decode)) if decode is not None else (lambda w: 0.0)
        cached = await self.prefixes.lookup([w.worker_id for w in workers], prompt_token_ids, lora, _shared(workers))
        score = lambda w: (self.inflight.get(w.worker_id, 0) + cost(w)  # noqa: E731
                           - (cached[w.worker_id].credit(self.block_size) if w.worker_id in cached else 0.0))
        return min(workers, key=lambda w: (score(w), w.num_running + w.num_waiting))

    async def loras(self) -> dict[str, int]:
        """The adapters the usable workers serve, and how many workers serve each."""
        counts: dict[str, int] = {}
        for worker in await self.usable():
            for name in worker.loras:
                counts[name] = counts.get(name, 0) + 1
        return counts

    async def can_serve(self) -> bool:
        """A usable set of workers is registered: a prefill and a decode worker, or a colocated one."""
        roles = {w.role for w in await self.usable()}
        if not self.prefill_policy.needs_prefill_workers and "decode" in roles:
            return True  # it prefills its prompts itself
        return "both" in roles or {"prefill", "decode"} <= roles

    def track(self, worker_id: str, delta: int) -> None:
        self.inflight[worker_id] = self.inflight.get(worker_id, 0) + delta

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def _budget(value) -> int | None:
    """A heartbeat's ``step_prompt_budget``: None where the worker has no TPOT target (-1) or does not say."""
    return None if value is None or int(value) < 0 else int(value)


def _shared(workers: Sequence[WorkerView]) -> dict[str, str]:
    """Worker id -> the shared host KV tier it maps (its host and the tier's file), for those that map one."""
    return {w.worker_id: f"{w.host_id}/{w.kv_tier_shared}" for w in workers if w.kv_tier_shared and w.host_id}
