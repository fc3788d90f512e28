"""The engine loop the workers drive: add_request, abort_request, step.

``step()`` is schedule, run, update (with async scheduling, the update of the step launched
before: ``splitserve.engine.async_scheduling``); everything else is bookkeeping of requests and
turning them into ``RequestOutput``.
"""
from __future__ import annotations

import contextlib
import itertools
import tempfile
import threading
import time
from typing import Callable, Sequence

from splitserve.engine.config import EngineConfig
from splitserve.engine.block_pool import chain_root
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.kv_offload import HostPrefixTier
from splitserve.engine.shared_kv_tier import SharedPrefixTier, layout_digest, sweep_dead_tiers
from splitserve.engine.kv_connector import KVConnector
from splitserve.engine.lora.manager import AdapterInUse
from splitserve.engine.model_loader import load_tokenizer, resolve_model
from splitserve.engine import async_scheduling
from splitserve.engine.model_runner import ModelRunner, PoolFactory, default_pool
from splitserve.engine.outputs import RequestMetrics, RequestOutput
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import Scheduler, SchedulerOutput
from splitserve.engine.tensor_parallel import TP_FOLLOWER, FollowerProgram
from splitserve.engine.step_budget import StepBudget
from splitserve.engine.spec_decode.build import build_proposer
from splitserve.engine.grammar import GrammarCompiler


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic,
                 pool_factory: PoolFactory = default_pool, tp_follower: FollowerProgram = TP_FOLLOWER):
        """``pool_factory``: where the KV pool lives (a KV connector may want it in shared memory);
        ``tp_follower``: what the other tensor-parallel ranks run (``splitserve.engine.kv_connector``)."""
        self.config = config
        self.clock = clock
        model_dir = resolve_model(config.model)
        self.tokenizer = load_tokenizer(model_dir)
        self.model_name = config.model
        self.runner = ModelRunner(config, model_dir, pool_factory, tp_follower=tp_follower)
        hf = self.runner.model.config
        self.vocab_size = hf.vocab_size
        self.max_model_len = self.runner.max_model_len
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                 num_cpu_blocks=config.num_cpu_blocks if config.preemption_mode == "swap" else 0,
                                 windows=self.runner.kv_groups.windows,
                                 max_step_tokens=config.max_num_batched_tokens,
                                 offload=self._host_tier(config), overlap_loads=config.kv_offloading_overlap)
        self.scheduler = Scheduler(config, self.kv, self.max_model_len, clock=clock)
        self.scheduler.lora = self.runner.lora
        # Prefilled requests (a decode worker's) whose adapter waits for a LoRA slot to free.
        self._waiting_for_lora: list[Request] = []
        self.step_budget = StepBudget(config.target_tpot_ms, config.max_num_batched_tokens, config.block_size) \
            if config.target_tpot_ms else None
        self.proposer = build_proposer(config, self.runner)  # None unless speculative decoding is on
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.runner.eos_token_ids,
                                        cache_bytes=config.grammar_cache_mb << 20)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        # Held by the thread that steps this engine whenever it touches the engine's state (a worker's
        # EngineLoop), and let go while a step's forward computes: another thread may then take it to
        # reserve pages (a decode worker's Reserve, EngineLoop.run_during_step). None: one thread does all.
        self.state_lock: threading.Lock | None = None
        # Async scheduling (config.async_scheduling): None where each step is waited for.
        self.overlap = async_scheduling.OverlappedSteps(self) if async_scheduling.enabled(config, self.runner) else None

    def _host_tier(self, config: EngineConfig) -> HostPrefixTier | None:
        """The KV tiers below the pool (--kv-offloading-size, --kv-offloading-disk-size,
        --kv-offloading-shared)."""
        if config.kv_offloading_shared:
            sweep_dead_tiers()  # what killed workers left: no one holds it
            pool = self.runner.kv_pages
            return SharedPrefixTier(pool, config.kv_offloading_size, config.block_size,
                                    layout_digest(str(resolve_model(config.model)), pool, config.block_size))
        if self.runner.host_kv is None:
            return None
        disk_dir = None
        if config.kv_offloading_disk_size:
            disk_dir = tempfile.mkdtemp(prefix="splitserve-kv-", dir=config.kv_offloading_dir or None)
        return HostPrefixTier(self.runner.host_kv.num_slots, self.runner.host_kv, disk_dir,
                              int(config.kv_offloading_disk_size * 2**30))

    def close(self) -> None:
        """Stop what runs beside this process (the other ranks of a tensor-parallel engine); remove
        the disk tier's files; leave the prefix cache to a shared tier."""
        if self.kv.loader is not None:
            self.kv.loader.close()  # its copies write into the pool
        if isinstance(self.kv.offload, SharedPrefixTier):
            self.kv.offload.keep(self.kv.pool)
        self.runner.close()
        if self.kv.offload is not None:
            self.kv.offload.close()

    # ---- requests ------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | Sequence[int],
                    params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> Request:
        """Validate and queue one request. Bad input raises ValueError naming the field.
        ``params.lora``: an adapter added with ``add_lora`` to run it under (None: the base model)."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        text, token_ids = self._prompt_tokens(prompt)
        params.validate_for_vocab(self.vocab_size)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        total = len(token_ids) + params.max_tokens
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}")
        if self.kv.blocks_needed(min(total, self.max_model_len)) > self.kv.num_total_blocks:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) cannot fit the "
                             f"KV cache of {self.kv.num_total_blocks * self.config.block_size} tokens on this "
                             "engine; shorten the prompt or lower max_tokens")
        request = Request(request_id, token_ids, params, eos_token_ids=self.runner.eos_token_ids,
                          priority=priority, arrival_time=self.clock() if arrival_time is None else arrival_time,
                          prompt=text)
        request.grammar = self._grammar(params, token_ids)
        self._name_lora(request)  # its slot is taken when the scheduler admits it
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    # ---- LoRA adapters -------------------------------------------------------------------
    def add_lora(self, name: str, path) -> None:
        """Make the PEFT adapter in directory ``path`` available to requests as ``name``."""
        self._lora_manager().add(name, path)

    def read_lora(self, name: str, path):
        """Read and check an adapter without touching the engine's state (any thread: a worker
        reads off its engine thread, then ``register_lora`` on it)."""
        return self._lora_manager().read(name, path)

    def register_lora(self, adapter) -> None:
        self._lora_manager().register(adapter)

    def remove_lora(self, name: str) -> None:
        """Forget an adapter; AdapterInUse while a request here (running or waiting) names it."""
        manager = self._lora_manager()
        naming = sum(1 for r in self.requests.values() if r.lora == name)
        if name in manager.known and naming:
            raise AdapterInUse(f"LoRA adapter {name!r} is in use by {naming} request(s) on this engine")
        manager.remove(name)

    def list_loras(self) -> list[str]:
        return list(self.runner.lora.known) if self.runner.lora is not None else []

    def _lora_manager(self):
        if self.runner.lora is None:
            raise ValueError("lora: this engine serves no adapters (start it with enable_lora)")
        return self.runner.lora

    def _name_lora(self, request: Request) -> None:
        """The request's adapter (ValueError if this engine does not know it), not its slot yet."""
        name = request.sampling_params.lora
        if name is not None:
            if name not in self._lora_manager().known:
                raise ValueError(f"LoRA adapter {name!r} is not loaded here")
            request.lora = name
            request.cache_root = chain_root(name)

    def _forget(self, request: Request) -> None:
        """A request that ended leaves the engine (and gives its adapter slot back)."""
        if request in self._waiting_for_lora:
            self._waiting_for_lora.remove(request)
        if self.requests.pop(request.request_id, None) is not None and request.lora_slot is not None:
            self.runner.lora.release(request.lora)
            request.lora_slot = None

    def _resume_waiting_for_lora(self) -> None:
        """Prefilled requests whose adapter now has a slot start decoding, in arrival order."""
        for request in list(self._waiting_for_lora):
            if self.runner.lora.can_acquire(request.lora):
                self._waiting_for_lora.remove(request)
                request.lora_slot = self.runner.lora.acquire(request.lora)
                self.scheduler.add_running(request)

    def add_prefilled_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                              first_token: int, priority: int = 0,
                              first_logprobs: list[tuple[int, float]] | None = None,
                              arrival_time: float | None = None,
                              sampler_state: bytes | None = None) -> RequestOutput:
        """Admit a request whose prompt KV already sits in the pages reserved under its id.

        The prefill worker computed the prompt and sampled the first token; decoding goes on
        from there, as it would have on one engine: ``arrival_time`` (this engine's clock) keeps
        the request's place in the priority order, ``sampler_state`` (the prefill side's
        ``Request.sampler_state()``) continues a seeded random stream. Returns the output with
        that first token (finished if it already ends).
        """
        if not self.kv.owns(request_id):
            raise ValueError(f"request {request_id!r} has no reserved pages")
        _, token_ids = self._prompt_tokens(list(prompt_token_ids))
        request = Request(request_id, token_ids, params, eos_token_ids=self.runner.eos_token_ids,
                          priority=priority, arrival_time=self.clock() if arrival_time is None else arrival_time)
        request.grammar = self._grammar(params, token_ids)  # the first token is accepted below
        if sampler_state:
            request.restore_sampler_state(sampler_state)
        self._name_lora(request)
        request.num_computed_tokens = len(token_ids)
        request.num_cached_tokens = 0
        request.first_token_time = self.clock()
        self.kv.cache_full_blocks(request_id, token_ids, len(token_ids), request.cache_root)
        self.requests[request_id] = request
        request.append_token(first_token, first_logprobs)
        reason = request.check_stop(self.max_model_len)
        if reason is None and request.lora is not None and not self.runner.lora.can_acquire(request.lora):
            # Every slot holds another adapter of running requests: its pages stay reserved and
            # it decodes once one of them ends (each step looks: _resume_waiting_for_lora).
            self._waiting_for_lora.append(request)
            return self.request_output(request)
        if reason is None and request.lora is not None:
            request.lora_slot = self.runner.lora.acquire(request.lora)
        self.scheduler.add_running(request)
        if reason is not None:
            self.scheduler.finish(request, reason)
        return self.request_output(request)

    def _grammar(self, params: SamplingParams, token_ids: list[int]):
        """The request's structured-output matcher (None without a constraint), having replayed
        the tokens a retried request's prompt ends with (generated under it before)."""
        spec = params.structured_output
        if spec is None:
            return None
        if spec.resumed_tokens >= len(token_ids):
            raise ValueError(f"structured_output.resumed_tokens ({spec.resumed_tokens}) must be less than the "
                             f"prompt's {len(token_ids)} tokens")
        return self.grammars.grammar(spec, token_ids[len(token_ids) - spec.resumed_tokens:])

    def _prompt_tokens(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt token_ids must not be empty")
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {self.vocab_size})")
        return None, token_ids

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request wherever it is; its pages go back at once, or, while a step that may still
        write them is in flight (async scheduling), once it lands. None if unknown or done."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._forget(request)
        self.scheduler.abort(request)
        return self.request_output(request)

    def land(self) -> list[RequestOutput]:
        """Async scheduling: complete the step in flight, launching nothing after it (a caller that
        aborted everything it had waits for the pages held by that step)."""
        return self.overlap.land() if self.overlap is not None else []

    def has_unfinished_requests(self) -> bool:
        """Also while a step is in flight: its tokens are still to be read (and its held pages freed)."""
        in_flight = self.overlap is not None and self.overlap.in_flight is not None
        return self.scheduler.has_unfinished() or bool(self._waiting_for_lora) or in_flight

    # ---- the KV handoff's scheduler side (splitserve.engine.kv_connector.KVHandoffEngine) ----
    @property
    def tensor_parallel_size(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def kv_cache(self):
        """The pool as [slots, 2, blocks, block_size, kv_heads, row] (slots: every layer, unless
        windowed layers have KV groups of their own: ``runner.kv_groups``)."""
        return self.runner.kv_cache

    def blocks_needed(self, num_tokens: int) -> int:
        return self.kv.blocks_needed(num_tokens)

    def reserve_pages(self, request_id: str, num_tokens: int,
                      prompt_token_ids: Sequence[int] | None = None) -> tuple[list[int], int] | None:
        """Pages whose KV will be written from elsewhere: (page ids, leading prefix-cache hits), or
        None when the pool is short. Given the prompt, its head is served from this engine's prefix
        cache (shared pages, a ref each), as the samples of an ``n > 1`` request and prompts with a
        common system prefix want."""
        if self.kv.owns(request_id) or request_id in self.requests:
            raise ValueError(f"request {request_id!r} already has pages on this worker")
        if prompt_token_ids is not None and len(prompt_token_ids) != num_tokens:
            raise ValueError(f"prompt_token_ids has {len(prompt_token_ids)} tokens, num_prompt_tokens says "
                             f"{num_tokens}")
        hits = self.kv.find_cached_prefix(prompt_token_ids, load=True) if prompt_token_ids else []
        if self.kv.allocate(request_id, num_tokens, cached_blocks=hits) is None:
            return None
        return self.kv.block_table(request_id), len(hits)

    def release_pages(self, request_id: str) -> bool:
        """Free a reservation, or abort the request it became; False when there was neither."""
        if request_id in self.requests:
            self.abort_request(request_id)
            return True
        if self.kv.owns(request_id):
            self.kv.free(request_id)
            return True
        return False

    def set_aside_pages(self, request_id: str, holder: str) -> None:
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is running: its pages are its own")
        self.kv.rename(request_id, holder)

    def attach_kv_connector(self, connector: KVConnector | None) -> None:
        self.runner.kv_connector = connector

    def configure_follower_kv(self, message) -> list:
        return self.runner.configure_follower_kv(message)

    # ---- the loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> run -> update; with async scheduling the update is of the step before
        (``splitserve.engine.async_scheduling``), and a step that only launched returns nothing."""
        if self._waiting_for_lora:
            self._resume_waiting_for_lora()
        if self.overlap is not None:
            return self.overlap.step()
        return self.run_plan(self.schedule())

    def schedule(self) -> SchedulerOutput:
        with self.runner.phases.timing("schedule"):
            return self.scheduler.schedule()

    def run_plan(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Run ``plan`` and wait for its tokens: the requests it changed, as outputs."""
        phases = self.runner.phases
        started = time.perf_counter()
        if self.proposer is not None:
            with phases.timing("propose"):
                self.proposer.propose(plan)
        # Not with swaps: pages given up for a swap-out are copied out at the start of the run,
        # and another thread's reservation must not get them first.
        with self.state_let_go() if not (plan.swap_out or plan.swap_in) else contextlib.nullcontext():
            sampled = self.runner.run(plan)
        seconds = time.perf_counter() - started
        with phases.timing("update"):
            changed = self.scheduler.update(plan, sampled)
            self._budget_next_step(plan, seconds)
            return [self.request_output(r) for r in changed]

    @contextlib.contextmanager
    def state_let_go(self):
        """``state_lock`` let go for the block (a forward, the wait for a step's tokens), taken back
        after it. Meanwhile the forward reads its plan: its requests and their page lists (which
        ``plan.block_tables`` are, not copies). Another thread may then only make a reservation
        (``reserve_pages``): it takes free pages and references cached ones for an owner of its
        own, and changes no request and no other owner's pages."""
        lock = self.state_lock
        if lock is None:
            yield
            return
        lock.release()
        try:
            yield
        finally:
            lock.acquire()

    def _budget_next_step(self, plan, seconds: float) -> None:
        """Under ``target_tpot_ms``: learn from this step's time, size the next one's budget."""
        if self.step_budget is None or plan.is_empty:
            return
        # A speculative decode's positions run as decode rows (splitserve.engine.step_inputs.VerifyRow).
        decodes = sum(c.num_tokens for c in plan.chunks if c.is_decode or c.spec_token_ids)
        self.step_budget.observe(decodes, plan.num_batched_tokens - decodes, seconds)
        self.scheduler.token_budget = self.step_budget.budget(self._num_decoding())

    def _num_decoding(self) -> int:
        return sum(1 for r in self.scheduler.running if not r.is_finished and r.num_computed_tokens >= r.num_tokens - 1)

    def step_prompt_budget(self) -> int:
        """Prompt tokens the next step takes beside its decodes under ``target_tpot_ms``; -1 without
        a target (a gateway deciding where to prefill a prompt reads it, splitserve/gateway/prefill_placement.py)."""
        if self.step_budget is None:
            return -1
        decoding = self._num_decoding()
        return max(self.step_budget.budget(decoding) - decoding, 0)

    def request_output(self, request: Request) -> RequestOutput:
        finished = request.is_finished
        if finished:
            self._forget(request)
        reason = request.finish_reason
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True) if finished else "",
            finished=finished,
            finish_reason=str(reason) if reason is not None else None,
            logprobs=list(request.output_logprobs) if request.sampling_params.logprobs is not None else None,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_preemptions=request.num_preemptions,
            metrics=RequestMetrics(request.arrival_time, request.first_scheduled_time,
                                   request.first_token_time, self.clock() if finished else None),
        )

    # ---- checks ----------------------------------------------------------------------
    def stats(self) -> dict[str, float | str]:
        return {
            "kv_cache_dtype": self.config.kv_cache_dtype,
            "kv_page_bytes": self.runner.kv_bytes_per_token * self.runner.block_size,
            "kv_blocks_total": self.kv.num_total_blocks,
            "kv_blocks_free": self.kv.num_free_blocks,
            "kv_blocks_cached": self.kv.num_cached_blocks,
            "kv_usage": self.kv.usage,
            "prefix_cache_hit_rate": self.kv.prefix_stats.hit_rate,
            "num_running": sum(1 for r in self.scheduler.running if not r.is_finished),
            "num_waiting": len(self.scheduler.waiting) + len(self._waiting_for_lora),
            "num_preemptions": self.scheduler.num_preemptions,
            "step_prompt_budget": self.step_prompt_budget(),
            "spec_decode_num_drafts": self.scheduler.spec_stats.num_drafts,
            "spec_decode_num_draft_tokens": self.scheduler.spec_stats.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.scheduler.spec_stats.num_accepted_tokens,
            "grammar_cache_bytes": self.grammars.cached_bytes,
            "grammar_cache_hits": self.grammars.hits,
            "grammar_cache_misses": self.grammars.misses,
            "loras": self.list_loras(),
            # Which shared host KV tier this engine maps: the gateway credits its peers' pages there.
            "kv_tier_shared": self.kv.offload.path.name if isinstance(self.kv.offload, SharedPrefixTier) else "",
        }

    def assert_idle(self) -> None:
        """No request in flight and every page free or cached (run after every engine test)."""
        if self.has_unfinished_requests() or self.scheduler.running:
            raise AssertionError("requests still scheduled")
        self.kv.assert_idle()

