"""A request's life inside the engine: its tokens, progress and how it ended."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.spec_state import SpecState
from splitserve.engine.grammar import Grammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: pages wait in host memory
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_tokens or the model's length limit
    EOS = "eos"
    STOP = "stop"  # a stop token id (or, above the engine, a stop string)
    ABORTED = "aborted"

    def __str__(self) -> str:
        return self.value


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Sampled token's logprob then the top-n, per output token, when asked for.
    output_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Tokens whose KV is in the cache (prompt and output alike).
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first admission.
    num_cached_tokens: int = -1
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Static batching only: a finished member keeps its row until the batch ends.
    padding_steps: int = 0
    generator: torch.Generator | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # The structured-output matcher (set by the engine when the params ask for one); it advances
    # with every appended token, so preemption (recompute or swap) keeps it as it is.
    grammar: Grammar | None = None
    # Speculative decoding's state (acceptance, back-off, draft KV progress); None until the
    # scheduler first reserves proposal slots for it.
    spec: SpecState | None = None
    # LoRA: the adapter the request runs under (None: the base model) and its slot while it runs.
    lora: str | None = None
    lora_slot: int | None = None
    # Where the chain of its prefix-cache hashes starts (None: the base model's chain): KV
    # computed under one adapter is never served to a request under another, or the base model.
    cache_root: int | None = None

    def __post_init__(self) -> None:
        # prompt + output, maintained incrementally: the scheduler reads it every step.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def sampler_state(self) -> bytes | None:
        """The seeded generator's state (None without a seed), so that another engine continues
        the same random stream (a prefill worker hands it to the decode worker)."""
        return None if self.generator is None else self.generator.get_state().numpy().tobytes()

    def restore_sampler_state(self, state: bytes) -> None:
        """Continue from ``sampler_state()`` of the same request on another engine."""
        if self.generator is None:
            raise ValueError("sampler_state given for a request without a seed")
        try:
            self.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        except RuntimeError as e:
            raise ValueError(f"sampler_state is not a generator state ({len(state)} bytes): {e}") from None

    def append_token(self, token_id: int, logprobs: list[tuple[int, float]] | None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def check_stop(self, max_model_len: int) -> FinishReason | None:
        """Why the request ends after its newest token, or None to go on."""
        params = self.sampling_params
        n_out = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        if n_out >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return FinishReason.EOS
            if last in params.stop_token_ids:
                return FinishReason.STOP
        # The grammar is complete (it took a stop token, e.g. EOS under ignore_eos) or refused a
        # token: nothing valid can follow.
        if self.grammar is not None and (self.grammar.is_terminated or not self.grammar.ok):
            return FinishReason.STOP
        if n_out >= params.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None
