"""Continuous batching: which tokens of which requests run in the next step.

Every step has one token budget (``max_num_batched_tokens``) shared by decodes and prefill
chunks. Running requests go first; waiting ones join while budget, ``max_num_seqs`` and
KV pages allow. When pages run out, the lowest-priority (then latest) request is preempted
by recompute (its pages are dropped; it re-prefills later, often from the prefix cache) or
by swap (its pages move to host memory and come back intact).

In-batch prefix sharing (prefix caching on, continuous batching): a waiting request whose next
uncached prompt block is being computed by a running prefill waits a step (keeping its place, not
holding back the others) and then reads that block from the prefix cache instead of computing it too.

``batching="static"`` is the baseline continuous batching is measured against: a batch
is admitted only when the previous one has fully ended, and finished members keep
computing padding rows until the longest member ends, as a static ``generate`` does.

Speculative decoding (``speculative_method``): a decode also reserves pages and budget for up
to ``num_speculative_tokens`` proposals (its ``lookahead``); the engine's proposer fills them in
before the forward (``splitserve.engine.spec_decode``), the runner verifies them, and ``update`` keeps the
accepted run: the request's computed tokens end after its last accepted proposal, the pages
past its new length go back, and the KV written for rejected proposals is overwritten later.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.priority import priority_key
from splitserve.engine.request import FinishReason, Request, RequestStatus
from splitserve.engine.spec_state import SpecDecodeStats, SpecState


@dataclass
class ScheduledChunk:
    request: Request
    # Position of the first token fed this step (the request's computed tokens before it).
    start: int
    # Tokens fed this step: 1 for a decode, up to the whole prompt for a prefill.
    num_tokens: int
    # The chunk reaches the request's newest token, so its last logits are sampled.
    samples: bool
    # Static batching: the row of a finished member, computed and discarded.
    padding: bool = False
    # Speculative decoding: proposal slots reserved for this decode (pages and budget) until the
    # proposer fills them in; then ``spec_token_ids`` holds the proposals, fed after the
    # request's newest token (``num_tokens`` counts them) and verified, and lookahead is 0.
    lookahead: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    # Draft method: the draft's distribution of each proposal, [len(spec_token_ids), vocab]
    # (rejection sampling needs q); None: each proposal is a point mass (ngram, greedy drafts).
    draft_probs: object = None
    # Async scheduling: the token fed is the one the step still in flight samples in this row of
    # its sampled tokens (splitserve.engine.async_scheduling); it is on the device, not yet in
    # the request. None: the token is the request's own (``all_token_ids[start]``).
    in_flight_row: int | None = None

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1


@dataclass
class SchedulerOutput:
    # Decodes first, then prefill chunks: the runner relies on that order.
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # (device block, host block) pairs to copy out before the forward runs.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    # (host block, device block) pairs to copy in before the forward runs.
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Block table of every scheduled request, as it stands after this step's allocations: the
    # first KV group's (every layer's, unless the model mixes attention kinds: kv_groups).
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    # The tables of the other KV groups, per scheduled request; empty with one group.
    group_block_tables: dict[str, list[list[int]]] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens + c.lookahead for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SampledToken:
    token_id: int
    logprobs: list[tuple[int, float]] | None = None


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.clock = clock
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Tokens the next step may hold; splitserve.engine.step_budget lowers it under a latency target.
        self.token_budget = config.max_num_batched_tokens
        self.spec_stats = SpecDecodeStats()
        # Tokens appended by update() (a speculative step may append several per request).
        self.num_sampled_tokens = 0
        # Times a waiting request was passed over because a running prefill computes its prefix.
        self.num_deferred_for_prefix = 0
        # The engine's LoRA slots (splitserve.engine.lora.manager.LoRAManager; None: no adapters).
        # A request under an adapter takes its slot when it is admitted, and waits while every
        # slot holds another adapter of running requests.
        self.lora = None
        # Times a waiting request was passed over because no LoRA slot was free for its adapter.
        self.num_deferred_for_lora = 0
        # Times a waiting request was passed over while its prefix came back from a KV tier.
        self.num_deferred_for_load = 0
        # Async scheduling: while a step is in flight, the pages of requests that ended meanwhile,
        # by the ids they are held under; they go back once that step has landed, since it may
        # still write them (None: nothing in flight, pages go back at once).
        self.held_pages: list[str] | None = None
        self._holders = itertools.count()

    # ---- queue management ------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A request whose KV is already computed (handed over by a prefill worker). It may take
        ``running`` past ``max_num_seqs`` (its pages were reserved up front); ``schedule`` then
        steps at most ``max_num_seqs`` of them at a time, most urgent first."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def abort(self, request: Request) -> None:
        if request.is_finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self._end(request, FinishReason.ABORTED)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(not r.is_finished for r in self.running)

    def _rank(self, request: Request, now: float) -> tuple[float, float]:
        """Smaller runs first. Priority ages by waiting time so nothing starves: the rule of
        ``splitserve.engine.priority``, the same one the gateway's Redis queue follows."""
        if self.config.scheduling_policy == "priority":
            return priority_key(request.priority, request.arrival_time, self.config.priority_aging_per_s)
        return 0.0, request.arrival_time

    # ---- scheduling ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput()
        budget = self.token_budget
        if self.config.batching == "static" and all(r.is_finished for r in self.running):
            self._release_static_batch()
        if self.kv.loader is not None:  # tier loads that ended: their blocks are device hits now
            self.kv.loader.finish(wait=not any(not r.is_finished for r in self.running))
        self.running.sort(key=lambda r: self._rank(r, now))
        scheduled: set[str] = set()

        for request in list(self.running):
            if len(out.chunks) >= self._max_running():
                # Handed-over requests (add_running) may outnumber the batch's rows: the least
                # urgent keep their pages and wait for a row (the step holds max_num_seqs).
                break
            if request not in self.running:  # preempted earlier in this loop
                continue
            padding = request.is_finished
            remaining = 1 if padding else request.num_tokens - request.num_computed_tokens
            n = min(remaining, budget)
            if n == 0:
                continue
            if self.kv.frees_pages:  # pages behind a window go back before this step takes new ones
                self.kv.slide(request.request_id, request.num_computed_tokens)
            # Proposal slots only where the pool has room: speculation never preempts anyone.
            lookahead = 0 if padding or n != remaining or n != 1 else self._lookahead(request, budget - n)
            if lookahead and self.kv.allocate(request.request_id, request.num_computed_tokens + n + lookahead) is None:
                lookahead = 0
            while self.kv.allocate(request.request_id, request.num_computed_tokens + n) is None:
                victim = self._pick_victim(exclude=scheduled)
                self._preempt(victim, out)
                if victim is request:
                    break
            if request not in self.running:
                continue
            out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, n,
                                             samples=not padding and n == remaining, padding=padding,
                                             lookahead=lookahead))
            scheduled.add(request.request_id)
            budget -= n + lookahead

        # Static batching admits a new batch only once the last one has fully ended.
        if not out.preempted and (self.config.batching == "continuous" or not self.running):
            self._admit_waiting(out, budget, now)

        out.chunks.sort(key=lambda c: not c.is_decode)
        groups = len(self.kv.windows)
        for chunk in out.chunks:
            rid = chunk.request.request_id
            out.block_tables[rid] = self.kv.block_table(rid)
            if groups > 1:
                out.group_block_tables[rid] = self.kv.block_tables(rid)[1:]
            if chunk.request.first_scheduled_time is None:
                chunk.request.first_scheduled_time = now
        return out

    def _lookahead(self, request: Request, budget: int) -> int:
        """Proposal slots for a decode of ``request``: 0 with speculation off, under a grammar (its
        state cannot follow hypothetical tokens), while the request backs off, or where the
        proposals and the token their verification adds would pass max_tokens or max_model_len."""
        if not self.config.speculative_method or request.grammar is not None:
            return 0
        room = min(request.sampling_params.max_tokens - len(request.output_token_ids),
                   self.max_model_len - request.num_tokens) - 1
        k = min(self.config.num_speculative_tokens, room, budget)
        if k <= 0:
            return 0
        if request.spec is None:
            request.spec = SpecState()
        return k if request.spec.wants_proposals() else 0

    def _release_static_batch(self) -> None:
        for r in self.running:
            self.kv.free(r.request_id)
        self.running.clear()

    def _max_running(self) -> int:
        if self.config.batching == "static":
            return min(self.config.max_num_seqs, self.config.static_batch_size)
        return self.config.max_num_seqs

    def _admit_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        self.waiting.sort(key=lambda r: self._rank(r, now))
        in_flight = self._blocks_in_flight()
        i = 0  # waiting[:i] are deferred this step; they keep their places
        while i < len(self.waiting) and budget > 0 and len(self.running) < self._max_running():
            request = self.waiting[i]
            if in_flight and self._prefix_in_flight(request, in_flight):
                self.num_deferred_for_prefix += 1
                i += 1
                continue
            if request.lora is not None and request.lora_slot is None and not self.lora.can_acquire(request.lora):
                self.num_deferred_for_lora += 1
                i += 1
                continue
            if self._loading(request):
                self.num_deferred_for_load += 1
                i += 1
                continue
            if not self.config.enable_chunked_prefill and request.status is RequestStatus.WAITING \
                    and request.num_tokens > budget:
                return
            admitted = self._admit(request, out, budget)
            while admitted is None:
                victim = self._pick_victim(exclude=set())
                if victim is None or self._rank(victim, now) <= self._rank(request, now) \
                        or self.config.scheduling_policy != "priority":
                    return
                # A more urgent arrival takes the pages of less urgent running work.
                self._preempt(victim, out)
                out.chunks = [c for c in out.chunks if c.request is not victim]
                budget = self.token_budget - out.num_batched_tokens
                in_flight = self._blocks_in_flight()  # the victim no longer computes its blocks
                admitted = self._admit(request, out, budget)
            self.waiting.pop(i)
            if request.lora is not None and request.lora_slot is None:  # (can_acquire said yes above)
                request.lora_slot = self.lora.acquire(request.lora)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(admitted)
            budget -= admitted.num_tokens
            if in_flight is not None and self._is_prefilling(request):
                in_flight.update(self.kv.unregistered_block_hashes(request.request_id, request.all_token_ids,
                                                                   request.cache_root))

    def _blocks_in_flight(self) -> set[int] | None:
        """Hashes of the full blocks that running prefills compute in this or coming steps and
        that are not in the prefix cache yet. Rebuilt every step from ``running``, so a preempted
        or aborted prefill defers nobody after it. None: no prefix sharing (caching off, whose
        blocks would never appear; or static batching, whose batches are admitted whole)."""
        if not self.kv.enable_prefix_caching or self.config.batching != "continuous":
            return None
        in_flight: set[int] = set()
        for r in self.running:
            if self._is_prefilling(r):
                in_flight.update(self.kv.unregistered_block_hashes(r.request_id, r.all_token_ids, r.cache_root))
        return in_flight

    @staticmethod
    def _is_prefilling(request: Request) -> bool:
        # A decode has one token to feed (its newest); a prefill, more.
        return not request.is_finished and request.num_tokens - request.num_computed_tokens > 1

    def _prefix_in_flight(self, request: Request, in_flight: set[int]) -> bool:
        """A waiting request's next uncached block is being computed by a running prefill: after
        that step it is a cache hit, so admitting it now would compute the block twice. A swapped
        request keeps its own pages and never waits for this."""
        if request.status is not RequestStatus.WAITING:
            return False
        cached = self.kv.find_cached_prefix(request.all_token_ids, request.cache_root)
        return self.kv.next_block_hash(request.all_token_ids, cached, request.cache_root) in in_flight

    def _loading(self, request: Request) -> bool:
        """A waiting request's cached prefix continues in a KV tier and is being brought back
        (started now, or by an earlier request's load): it waits, the step goes on for others."""
        if self.kv.loader is None or request.status is not RequestStatus.WAITING:
            return False
        device_hit = self.kv.find_cached_prefix(request.all_token_ids, request.cache_root)
        return self.kv.loader.start(request.all_token_ids, device_hit, request.cache_root)

    def _admit(self, request: Request, out: SchedulerOutput, budget: int) -> ScheduledChunk | None:
        """Give a waiting request its pages; None when the pool is short."""
        rid = request.request_id
        if request.status is RequestStatus.SWAPPED:
            extra = self.kv.blocks_needed(request.num_tokens) - self.kv.num_swap_in_blocks(rid)
            if self.kv.num_swap_in_blocks(rid) + max(extra, 0) > self.kv.num_free_blocks:
                return None
            out.swap_in.extend(self.kv.swap_in(rid))
            start = request.num_computed_tokens
        else:
            cached = self.kv.find_cached_prefix(request.all_token_ids, request.cache_root, load=True)
            start = len(cached) * self.kv.block_size
            remaining = request.num_tokens - start
            if self.kv.allocate(rid, start + min(remaining, budget), cached) is None:
                return None
            self.kv.prefix_stats.queries += request.num_tokens
            self.kv.prefix_stats.hits += start
            request.num_computed_tokens = start
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = start
        remaining = request.num_tokens - start
        n = min(remaining, budget)
        if self.kv.allocate(rid, start + n) is None:  # a swapped request's newest token
            raise RuntimeError("pool accounting error while admitting a swapped request")
        return ScheduledChunk(request, start, n, samples=n == remaining)

    def _pick_victim(self, exclude: set[str]) -> Request | None:
        """The least urgent running request not yet in this step (or the last resort)."""
        now = self.clock()
        candidates = [r for r in self.running if r.request_id not in exclude and not r.is_finished] \
            or [r for r in self.running if r.request_id not in exclude]
        if not candidates:
            return None
        return max(candidates, key=lambda r: self._rank(r, now))

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.num_preemptions += 1
        request.num_preemptions += 1
        out.preempted.append(request)
        if request.is_finished:  # a static padding row just goes
            self.kv.free(request.request_id)
            return
        if request.spec is not None:  # the draft's KV stays behind (recompute) or in unswapped pages
            request.spec.draft_computed = 0
        pairs = self.kv.swap_out(request.request_id) if self.config.preemption_mode == "swap" else None
        if pairs is not None:
            out.swap_out.extend(pairs)
            request.status = RequestStatus.SWAPPED
        else:
            self.kv.free(request.request_id)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
        self.waiting.append(request)

    # ---- after the forward -----------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, list[SampledToken]]) -> list[Request]:
        """Advance every scheduled request; returns those with new tokens or an end.

        ``sampled``: per sampling request its new tokens, one, or with proposals the accepted
        ones and the token their verification sampled after them."""
        changed = []
        for chunk in out.chunks:
            request = chunk.request
            request.num_computed_tokens = chunk.start + chunk.num_tokens
            if chunk.padding or request.is_finished:
                continue
            if not chunk.samples:
                self.kv.cache_full_blocks(request.request_id, request.all_token_ids, request.num_computed_tokens,
                                          request.cache_root)
                continue
            tokens = sampled[request.request_id]
            if chunk.spec_token_ids:
                self._accept(chunk, len(tokens) - 1)
            reason = None
            for token in tokens:  # an accepted run ends early at a stop token or a limit
                request.append_token(token.token_id, token.logprobs)
                self.num_sampled_tokens += 1
                reason = request.check_stop(self.max_model_len)
                if reason is not None:
                    break
            if request.first_token_time is None:
                request.first_token_time = self.clock()
            self.kv.cache_full_blocks(request.request_id, request.all_token_ids, request.num_computed_tokens,
                                      request.cache_root)
            if reason is not None:
                self.finish(request, reason)
            elif request.spec is not None:
                # Proposal pages the run did not reach go back (a new token's page comes next step).
                self.kv.trim(request.request_id, request.num_tokens)
            changed.append(request)
        if self.config.batching == "static" and self.running and all(r.is_finished for r in self.running):
            self._release_static_batch()  # the batch is over: its pages go now, not at the next step
        return changed

    def _accept(self, chunk: ScheduledChunk, accepted: int) -> None:
        """A verified decode: its computed tokens end after the last accepted proposal (the KV of
        rejected ones is garbage, overwritten when those positions are fed again)."""
        request, proposed = chunk.request, len(chunk.spec_token_ids)
        request.num_computed_tokens = chunk.start + 1 + accepted
        request.spec.draft_computed = min(request.spec.draft_computed, request.num_computed_tokens)
        request.spec.record(proposed, accepted)
        stats = self.spec_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += proposed
        stats.num_accepted_tokens += accepted

    def finish(self, request: Request, reason: FinishReason) -> None:
        if self.config.batching == "static":
            # Keep the row until the whole batch ends (the cost static batching pays).
            request.status = RequestStatus.FINISHED
            request.finish_reason = reason
            return
        self.running.remove(request)
        self._end(request, reason)

    def _end(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if self.held_pages is None:
            self.kv.free(request.request_id)
        elif self.kv.owns(request.request_id):
            # Held under an id of their own: the request's id is free at once (a retry may reserve
            # under it), and nothing that releases by that id frees them before the step lands.
            holder = f"{request.request_id}#held-{next(self._holders)}"
            self.kv.rename(request.request_id, holder)
            self.held_pages.append(holder)
