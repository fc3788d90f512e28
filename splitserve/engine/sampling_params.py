"""Per-request sampling parameters (names and defaults follow vLLM's ``SamplingParams``).

Every field is validated in ``__post_init__``; an invalid value raises ``ValueError`` whose
message starts with the field name and says what is allowed, e.g.
``"temperature must be >= 0, got -1.0"``.  Numeric fields are also type-checked: ``bool`` is
not accepted where a number is expected, and a ``str`` is never coerced.  Valid values are
normalised (ints/floats converted to the builtin types, ``top_k=-1`` -> ``0``, ``stop`` given as
one string -> a one-element list, tuples -> lists).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from splitserve.engine.structured_output import StructuredOutput

# Temperatures below this are treated as greedy (dividing logits by ~0 overflows); same
# threshold as vLLM.
SAMPLING_EPS = 1e-5

MAX_LOGPROBS = 20

# torch.Generator.manual_seed accepts this range.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_int(name: str, value) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def _check_float(name: str, value) -> float:
    if not _is_real(value):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    # Constrain the output to a JSON schema / JSON object / regex / choice (splitserve.engine.structured_output).
    structured_output: StructuredOutput | None = None
    # The LoRA adapter to run under (a name the engine was given with add_lora); None: the base
    # model. Not sampling, but resolved with it and sent with it to every worker of the request.
    lora: str | None = None

    def __post_init__(self) -> None:
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise ValueError(f"lora must be None or an adapter's name, got {self.lora!r}")
        # --- integers -------------------------------------------------------------------
        self.n = _check_int("n", self.n)
        if self.n != 1:
            raise ValueError(f"n must be 1 (only one completion per request is supported), got {self.n}")

        self.max_tokens = _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

        self.min_tokens = _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

        self.top_k = _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0

        if self.seed is not None:
            self.seed = _check_int("seed", self.seed)
            if not _SEED_MIN <= self.seed <= _SEED_MAX:
                raise ValueError(
                    f"seed must be None or an int in [{_SEED_MIN}, {_SEED_MAX}], got {self.seed}"
                )

        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {self.logprobs}"
                )

        # --- floats ---------------------------------------------------------------------
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

        for name in ("frequency_penalty", "presence_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)

        # --- others ---------------------------------------------------------------------
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(
                f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}"
            )
        ids = []
        for tok in self.stop_token_ids:
            if not _is_int(tok) or tok < 0:
                raise ValueError(
                    f"stop_token_ids must be a list of non-negative ints, got element {tok!r}"
                )
            ids.append(int(tok))
        self.stop_token_ids = ids

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got element {s!r}")
        self.stop = list(self.stop)

        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError("structured_output must be None or an splitserve.engine.structured_output.StructuredOutput, "
                             f"got {type(self.structured_output).__name__}")

    # --- convenience --------------------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        """Greedy (argmax) decoding: temperature ~0 (< 1e-5) or top_k == 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a stop token id is outside ``[0, vocab_size)``."""
        for tok in self.stop_token_ids:
            if tok >= vocab_size:
                raise ValueError(
                    f"stop_token_ids must be < vocab_size ({vocab_size}), got {tok}"
                )
