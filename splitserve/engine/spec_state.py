"""Speculative decoding's bookkeeping: per-request state (acceptance, back-off, draft KV progress)
and the engine-wide counters exported as vLLM's ``vllm:spec_decode_*`` metrics."""
from __future__ import annotations

from dataclasses import dataclass

# Rolling acceptance rate: each verified proposal moves it this far towards accepted/proposed.
EMA_WEIGHT = 0.2
# Below this rolling rate (after MIN_ROUNDS verifications) proposals are not worth their extra
# query tokens: the request decodes plainly for a while (its back-off), then tries again.
OFF_BELOW = 0.05
MIN_ROUNDS = 4
FIRST_BACKOFF_STEPS = 16
MAX_BACKOFF_STEPS = 256
# Where the rate restarts after a back-off: a few failed rounds switch it off again.
RETRY_EMA = 0.15


@dataclass
class SpecState:
    """One request's speculation state, kept across steps and preemptions."""

    # Rolling acceptance rate of its proposals (accepted / proposed per verification).
    ema: float = 1.0
    rounds: int = 0
    # Decode steps left without proposals (the off switch), and the next back-off's length.
    skip_steps: int = 0
    backoff_steps: int = FIRST_BACKOFF_STEPS
    # Draft method: tokens whose KV the draft model holds (a prefix of the request's tokens).
    draft_computed: int = 0

    def wants_proposals(self) -> bool:
        """False while backing off; counts one decode step of the back-off."""
        if self.skip_steps > 0:
            self.skip_steps -= 1
            return False
        return True

    def record(self, proposed: int, accepted: int) -> None:
        self.rounds += 1
        self.ema += EMA_WEIGHT * (accepted / proposed - self.ema)
        if self.rounds >= MIN_ROUNDS and self.ema < OFF_BELOW:
            self.skip_steps = self.backoff_steps
            self.backoff_steps = min(2 * self.backoff_steps, MAX_BACKOFF_STEPS)
            self.ema = RETRY_EMA
        elif self.ema >= 0.5:
            self.backoff_steps = FIRST_BACKOFF_STEPS  # paying again: a later slump backs off briefly


@dataclass
class SpecDecodeStats:
    """Engine-wide counters, named as vLLM's metrics: a draft is one sequence's proposal in one
    step (at least one token), accepted tokens are proposals the target agreed with (the extra
    token every verification samples is not counted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
