"""What the engine hands back: plain dataclasses, no protobuf."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # Every token generated so far (the whole list, not a delta).
    token_ids: list[int]
    # Detokenised output; filled once the request has finished.
    text: str
    finished: bool
    # "length", "eos", "stop" or "aborted" once finished; None before.
    finish_reason: str | None
    # Per output token: [(sampled id, logprob), (top-1 id, logprob), ...] when asked for.
    logprobs: list[list[tuple[int, float]]] | None = None
    # Prompt tokens whose KV came from the prefix cache.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
