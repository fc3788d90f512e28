"""One request as the gateway tracks it: what the client asked, what was streamed, how it ended.

The Generate handler and the dispatcher share a ``Job``: the dispatcher puts ``Tokens`` and
one ``Finished`` on ``Job.events``; the handler turns them into the client's stream.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import grpc

from gateway.workers import WorkerView
from splitserve.api_convert import DEFAULT_MAX_TOKENS
from splitserve.v1 import generation_pb2


@dataclass
class Tokens:
    token_ids: list[int]
    logprobs: list = field(default_factory=list)  # TokenLogprobs protos, one per token when asked


@dataclass
class Finished:
    finish_reason: str  # length | eos | stop | aborted | deadline | error
    status: grpc.StatusCode | None = None  # set when the request failed
    message: str = ""


class WorkerLost(Exception):
    """A worker under the request died, froze or voided the handoff: worth another attempt."""


@dataclass
class Retry:
    reason: str


@dataclass
class Job:
    request_id: str
    prompt_token_ids: list[int]
    sampling: generation_pb2.SamplingParams
    priority: int
    deadline: float | None  # time.monotonic() seconds, from the client's gRPC deadline
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    epoch: int = 0
    attempt: int = 0
    generated: list[int] = field(default_factory=list)  # tokens handed to the client so far
    lost: str | None = None  # set by the watchdog when the current attempt's worker stopped answering
    tracked: list[str] = field(default_factory=list)  # worker ids counted in the directory's load
    recorded: bool = False  # its terminal state went to Redis (or is queued to)
    timeline: dict = field(default_factory=dict)
    prefill_worker: WorkerView | None = None
    decode_worker: WorkerView | None = None
    cached_prompt_tokens: int = 0
    calls: list = field(default_factory=list)  # in-flight gRPC calls, cancelled with the job

    def deadline_passed(self, slack_s: float = 0.25) -> bool:
        """True at (or just before) the deadline: the handler's clock starts a little after
        gRPC's, so an RPC that gRPC ends for its deadline can look a few ms early here."""
        return self.deadline is not None and time.monotonic() >= self.deadline - slack_s

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def emit(self, token_ids: list[int], logprobs: list) -> None:
        self.generated += token_ids
        self.events.put(Tokens(token_ids, logprobs))

    def resume_inputs(self) -> tuple[list[int], generation_pb2.SamplingParams] | None:
        """Prompt and sampling for the next attempt: the tokens already streamed become part of
        the prompt and count against max_tokens / min_tokens. None if nothing is left to generate."""
        if not self.generated:
            return self.prompt_token_ids, self.sampling
        done = len(self.generated)
        sampling = generation_pb2.SamplingParams()
        sampling.CopyFrom(self.sampling)
        left = (sampling.max_tokens if sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS) - done
        if left < 1:
            return None
        sampling.max_tokens = left
        if sampling.HasField("min_tokens"):
            sampling.min_tokens = max(0, sampling.min_tokens - done)
        return self.prompt_token_ids + self.generated, sampling
