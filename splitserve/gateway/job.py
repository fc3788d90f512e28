"""One request as the gateway tracks it, from admission to its one end.

A ``Job`` is a small state machine with a single owner of its end::

    ADMITTING --admitted--> QUEUED --claim--> PLACING --workers chosen--> RUNNING --+--> FINISHED
                            ^                  |                          |       |
                            +----- requeue ----+------ retry (a worker ---+       |
                                                        died or froze)            |
    any state ---------------------------------- finish(outcome) -----------------+

``finish()`` is the only way a request ends, whoever ends it (its workers' stream reaching a
finish reason, a stop string, the client leaving or cancelling, its deadline, Abort, the retry
limit, a drain, Redis giving up): the first call wins and is the only one with any effect. It
puts the one ``Finished`` on ``events`` (ending the client's stream), cancels the attempt
running on the workers (whose cleanup frees their pages) and hands the job to ``on_finish``,
which writes the terminal state to Redis once. Later calls return False and change nothing,
so no path has to know whether another got there first.

``events`` (an ``Outbox``) carries ``Tokens`` (in order, each token once, also across retries,
merged while the client is behind) and then one ``Finished``; the Generate handler turns them
into the client's stream.
"""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from typing import Callable

import grpc

from splitserve.engine.sampling_params import SamplingParams
from splitserve.gateway.outbox import Finished, Outbox, Tokens
from splitserve.common.tracing import RequestTrace

__all__ = ["Job", "JobState", "Tokens", "Finished", "cancelled", "deadline_exceeded", "unavailable"]


class JobState(str, enum.Enum):
    ADMITTING = "admitting"  # known here, not in Redis yet (the admission may still be refused)
    QUEUED = "queued"  # admitted, waiting in the Redis queue (also between two attempts)
    PLACING = "placing"  # claimed: workers being chosen, pages reserved
    RUNNING = "running"  # on its workers: prefilling, then decoding
    FINISHED = "finished"  # ended, once and for all


def cancelled(message: str = "cancelled") -> Finished:
    return Finished("aborted", grpc.StatusCode.CANCELLED, message)


def deadline_exceeded() -> Finished:
    return Finished("deadline", grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")


def unavailable(message: str) -> Finished:
    return Finished("error", grpc.StatusCode.UNAVAILABLE, message)


class Job:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                 arrival_s: float, deadline: float | None, on_finish: Callable[["Job"], None], text=None,
                 owner: str = ""):
        """``text``: a ``TextStream`` for the client's text and stop strings (None: ids only);
        ``owner``: the identity that created it (``splitserve.common.authz``), who may abort it."""
        self.request_id = request_id
        self.owner = owner
        self.prompt_token_ids = prompt_token_ids
        self.params = params  # resolved at the edge; workers apply no defaults
        self.priority = priority
        self.arrival_s = arrival_s  # admission, Unix seconds: its place in every queue
        self.deadline = deadline  # time.monotonic() seconds, from the client's gRPC deadline
        self._on_finish = on_finish
        self.text = text
        self.chat_output = None  # its answer's parser (splitserve.gateway.chat_output), when it needs one
        self.state = JobState.ADMITTING
        self.outcome: Finished | None = None
        self.events = Outbox()  # what the client has yet to take: Tokens, then one Finished
        self.epoch = 0  # of the current claim (fences the Redis writes of stale attempts)
        self.attempt = 0
        self.gated = True  # the current claim holds the placement gate (placing may take capacity)
        self.generated: list[int] = []  # tokens handed to the client so far
        self.lost: str | None = None  # set by the watchdog when the attempt's worker stopped answering
        self.task: asyncio.Task | None = None  # the attempt running on workers
        self.timeline: dict = {"arrival": time.monotonic()}
        self.prefill_worker = None  # WorkerView of the current (last) attempt
        self.decode_worker = None
        self.cached_prompt_tokens = 0
        # A decode worker to try first (a later sample of an n > 1 request: where the first
        # sample's prompt KV sits, its pages are shared rather than sent again).
        self.prefer_decode: str | None = None
        # Its decode worker has streamed to it: the prompt's KV is in that worker's prefix cache.
        self.decoding = False
        self.trace = RequestTrace(recording=False)  # the servicer's, once it admits the request

    @property
    def finished(self) -> bool:
        return self.outcome is not None

    def finish(self, outcome: Finished) -> bool:
        """End the request with ``outcome``; True for the call that did, False for every later one."""
        if self.outcome is not None:
            return False
        self.outcome = outcome
        self.state = JobState.FINISHED
        self.timeline["finished"] = time.monotonic()
        self.events.put_nowait(outcome)
        self.trace.end(outcome.finish_reason, f"{outcome.status.name}: {outcome.message}" if outcome.status else None,
                       len(self.generated), self.attempt)
        task = self.task
        if task is not None and not task.done() and task is not _current_task():
            task.cancel()  # its cleanup aborts the request on its workers
        self._on_finish(self)
        return True

    def emit(self, token_ids: list[int], logprobs: list) -> None:
        """New tokens from the workers; none once the request has ended. A stop string in their
        text ends the request here, before anything the workers say after these tokens."""
        if self.outcome is not None:
            return
        self.timeline.setdefault("first_token", time.monotonic())
        self.generated += token_ids
        text, matched = self.text.feed(token_ids) if self.text is not None else ("", None)
        self.events.put_nowait(Tokens(token_ids, logprobs, text))
        if matched is not None:
            self.finish(Finished("stop"))

    # ---- time ----------------------------------------------------------------------
    def deadline_passed(self, slack_s: float = 0.25) -> bool:
        """True at (or just before) the deadline: the handler's clock starts a little after
        gRPC's, so an RPC that gRPC ends for its deadline can look a few ms early here."""
        return self.deadline is not None and time.monotonic() >= self.deadline - slack_s

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def timeout(self, cap: float | None) -> float | None:
        """A call's timeout: ``cap``, or less if the request's deadline comes first."""
        remaining = self.remaining()
        if remaining is None:
            return cap
        return remaining if cap is None else min(cap, remaining)

    # ---- retries -------------------------------------------------------------------
    def resume_inputs(self) -> tuple[list[int], SamplingParams] | None:
        """Prompt and sampling for the next attempt: the tokens already streamed become part of
        the prompt and count against max_tokens / min_tokens. None if nothing is left to generate."""
        if not self.generated:
            return self.prompt_token_ids, self.params
        done = len(self.generated)
        left = self.params.max_tokens - done
        if left < 1:
            return None
        structured = self.params.structured_output
        params = dataclasses.replace(self.params, max_tokens=left, min_tokens=max(0, self.params.min_tokens - done),
                                     # the grammar state covers the streamed tokens: the worker replays them
                                     structured_output=structured.resumed(done) if structured else None)
        return self.prompt_token_ids + self.generated, params

    # ---- what is recorded ------------------------------------------------------------
    def timeline_fields(self) -> dict:
        """Where the time went, in ms (the fields of the public ``Timeline``)."""
        t = self.timeline
        ms = lambda a, b: 1000 * (t[b] - t[a]) if a in t and b in t else 0.0  # noqa: E731
        return {"queued_ms": ms("arrival", "dispatched"), "prefill_ms": t.get("prefill_ms", 0.0),
                "kv_transfer_ms": t.get("kv_transfer_ms", 0.0), "first_token_ms": ms("arrival", "first_token"),
                "decode_ms": ms("first_token", "finished"),
                "prefill_worker": self.prefill_worker.worker_id if self.prefill_worker else "",
                "decode_worker": self.decode_worker.worker_id if self.decode_worker else ""}

    def terminal_fields(self) -> dict:
        """What Redis keeps of the ended request (for GetRequest)."""
        outcome = self.outcome
        return {"finish_reason": outcome.finish_reason, "error": outcome.message if outcome.status else "",
                "completion_tokens": len(self.generated), "timeline": self.timeline_fields()}


def _current_task() -> asyncio.Task | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop (unit tests may drive a job by hand)
        return None
