"""Async scheduling: the host plans and prepares step N+1 while the device runs step N.

On a GPU a step's forward is queued, not waited for; what the host does around it (scheduling,
building inputs, reading the sampled tokens, stop checks, detokenizing, handing tokens on) costs
step time only while the device has nothing queued. vLLM v1's async scheduling takes that work off
the critical path; this is the same idea for the steps where it is simple and safe:

* a step is *launched*: forward and sampling queued, the sampled tokens left on the device with a
  non-blocking copy to the host behind an event (``LaunchedStep``);
* before the host reads them, the next step is planned as if every request goes on
  (``plan_ahead``: one more decode each, its page allocated), its inputs built, and its input ids
  copied on the device from the launched step's tokens; it is launched in turn;
* only then are the first step's tokens read and the scheduler updated, as after a synchronous
  step. A request that stopped there (EOS, a stop token) had one more row computed in the step
  behind it, which is discarded.

A request that ends while a step is in flight keeps its pages until that step has landed
(``Scheduler.held_pages``): the step may still write them, and pages freed at once could be handed
to a KV transfer or another request meanwhile.

Only plain continuations overlap: the next plan is the launched step's requests, one decode further
each, when nothing else waits (no waiting request, no running one the launched step left out) and
every row samples without its history (``splitserve.engine.sampler.reads_no_history``). Anything
else (a new prompt, preemption, grammars, penalties, logprobs, a KV handoff on a prefill worker)
ends the overlap for a step: the step in flight is completed and the next one scheduled as usual,
then launched the same way if every row it samples is history-free, else run synchronously.
Speculative decoding, static batching, tensor parallelism, LoRA, windowed pages and
``target_tpot_ms`` turn it off (``blocker``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampler import SamplingRow, reads_no_history
from splitserve.engine.scheduler import SampledToken, ScheduledChunk, Scheduler, SchedulerOutput
from splitserve.engine.token_draw import to_device

if TYPE_CHECKING:
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


def blocker(config: EngineConfig, runner: ModelRunner) -> str | None:
    """What keeps this engine from scheduling asynchronously, or None."""
    return config.async_scheduling_blocker() or ("windowed layers freeing pages" if runner.kv_groups.frees_pages
                                                 else None)


def enabled(config: EngineConfig, runner: ModelRunner) -> bool:
    """``async_scheduling``: "auto" is on where the device runs asynchronously to the host (CUDA)
    and nothing blocks it; "on" where something does is an error naming it."""
    why_not = blocker(config, runner)
    if config.async_scheduling == "on" and why_not:
        raise ValueError(f"async_scheduling='on' does not go with {why_not}")
    if config.async_scheduling == "auto":
        why_not = why_not or (None if runner.device.type == "cuda" else "a CPU runs each step as it is queued")
    elif config.async_scheduling == "off":
        why_not = "async_scheduling='off'"
    log.info("async scheduling %s", f"off: {why_not}" if why_not else "on")
    return why_not is None


@dataclass
class LaunchedStep:
    """A step queued on the device whose tokens the host has not read yet."""

    plan: SchedulerOutput
    # The sampling chunks, in the order of ``tokens``' rows.
    chunks: list[ScheduledChunk]
    # One sampled token per row, on the device: the next step's input ids are copied from it.
    tokens: torch.Tensor
    # ``tokens`` copied to host memory, valid once ``landed`` has passed (``tokens`` itself on a CPU).
    host_tokens: torch.Tensor
    # Recorded on the device after that copy; None on a CPU, where the step ran as it was launched.
    landed: torch.cuda.Event | None
    # The pages of requests that ended while this step was in flight, by the ids they are held
    # under (``Scheduler._end``): they go back once it has landed.
    held_pages: list[str] = field(default_factory=list)

    def sampled(self) -> dict[str, list[SampledToken]]:
        """Each sampling request's token, waiting for the device if it has not got there yet."""
        if self.landed is not None:
            self.landed.synchronize()
        return {c.request.request_id: [SampledToken(t)] for c, t in zip(self.chunks, self.host_tokens.tolist())}

    def feed(self, plan: SchedulerOutput) -> Callable[[torch.Tensor], None]:
        """Writes, on the device, the tokens ``plan``'s decodes take from this step into its input ids."""
        rows = [c.in_flight_row for c in plan.chunks]
        src = to_device(rows, torch.long, self.tokens.device)

        def write(input_ids: torch.Tensor) -> None:
            input_ids[:len(rows)].copy_(self.tokens.index_select(0, src))
        return write


@torch.inference_mode()
def launch(runner: ModelRunner, plan: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
    """Queue ``plan``'s forward and sampling; ``previous``: the step in flight whose tokens it feeds."""
    runner.phases.steps += 1
    logits, chunks = runner.logits(plan, previous.feed(plan) if previous is not None else None)
    with runner.phases.timing("sample"):
        tokens = runner.sampler.device_tokens(logits, [SamplingRow.of(c.request) for c in chunks])
        if tokens.device.type == "cpu":
            return LaunchedStep(plan, chunks, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
        return LaunchedStep(plan, chunks, tokens, host, landed)


def launchable(plan: SchedulerOutput, runner: ModelRunner) -> bool:
    """``plan`` can run without the host waiting for it: no swaps, no speculation or padding rows, every
    sampled row history-free, and no KV handoff saving this step's layers (a prefill worker's)."""
    return (not plan.is_empty and not plan.swap_in and not plan.swap_out and runner.kv_connector is None
            and not any(c.padding or c.lookahead or c.spec_token_ids for c in plan.chunks)
            and all(reads_no_history(SamplingRow.of(c.request)) for c in plan.chunks if c.samples))


def plan_ahead(scheduler: Scheduler, launched: SchedulerOutput) -> SchedulerOutput | None:
    """The step after ``launched`` while its tokens are still on the device: each of its requests one
    decode further, fed the token it is sampling. None where the next step is anything else (someone
    waits, a chunk of ``launched`` did not sample, the pool is short): the caller then completes
    ``launched`` first and schedules as usual."""
    if scheduler.waiting or not all(c.samples for c in launched.chunks):
        return None
    stepped = {c.request.request_id for c in launched.chunks}
    if any(not r.is_finished and r.request_id not in stepped for r in scheduler.running):
        return None
    out = SchedulerOutput()
    kv = scheduler.kv
    for row, chunk in enumerate(launched.chunks):
        request = chunk.request
        position = chunk.start + chunk.num_tokens  # of the token being sampled
        if request.is_finished or _ends_for_sure(request, position + 1, scheduler.max_model_len):
            continue
        if kv.allocate(request.request_id, position + 1) is None:
            return None
        out.chunks.append(ScheduledChunk(request, position, 1, samples=True, in_flight_row=row))
        out.block_tables[request.request_id] = kv.block_table(request.request_id)
    return out if out.chunks else None


def _ends_for_sure(request, num_tokens: int, max_model_len: int) -> bool:
    """The token in flight takes the request to max_tokens or max_model_len (``Request.check_stop``)."""
    return len(request.output_token_ids) + 1 >= request.sampling_params.max_tokens or num_tokens >= max_model_len


class OverlappedSteps:
    """The engine's step with async scheduling on: each call launches the next step (when it can)
    and then completes the one launched before, so the host's work on step N's tokens runs while
    the device computes step N+1. A call where nothing was in flight only launches and returns no
    outputs; one that cannot plan ahead completes the step in flight, then schedules and launches
    (or runs) the next, so every call queues one step."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        # The step queued on the device whose tokens have not been read.
        self.in_flight: LaunchedStep | None = None
        # Steps launched ahead of their predecessor's tokens (they overlapped the host's work).
        self.num_overlapped = 0

    def step(self) -> list[RequestOutput]:
        engine = self.engine
        launched = self.in_flight
        outputs: list[RequestOutput] = []
        if launched is not None:
            with engine.runner.phases.timing("schedule"):
                ahead = plan_ahead(engine.scheduler, launched.plan)
            if ahead is not None and launchable(ahead, engine.runner):
                self._set_in_flight(launch(engine.runner, ahead, launched))
                self.num_overlapped += 1
                return self._complete(launched)
            # Anything but a plain continuation (its pages, if planned, stay with their requests):
            # the tokens first, then the next step is scheduled as usual, in this same call.
            outputs = self.land()
        plan = engine.schedule()
        if not launchable(plan, engine.runner):
            return outputs + engine.run_plan(plan)
        self._set_in_flight(launch(engine.runner, plan))
        return outputs

    def land(self) -> list[RequestOutput]:
        """Complete the step in flight and launch nothing after it ([] without one)."""
        launched = self.in_flight
        if launched is None:
            return []
        self._set_in_flight(None)
        return self._complete(launched)

    def _set_in_flight(self, step: LaunchedStep | None) -> None:
        self.in_flight = step
        # Ends from now on hold their pages until ``step`` has landed.
        self.engine.scheduler.held_pages = step.held_pages if step is not None else None

    def _complete(self, step: LaunchedStep) -> list[RequestOutput]:
        engine = self.engine
        with engine.state_let_go():  # pages a step in flight may write are held, never free
            sampled = step.sampled()
        for holder in step.held_pages:  # the step that could still write them has landed
            engine.kv.free(holder)
        with engine.runner.phases.timing("update"):
            changed = engine.scheduler.update(step.plan, sampled)
            return [engine.request_output(r) for r in changed]
