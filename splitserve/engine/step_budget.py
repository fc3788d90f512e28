"""The step's token budget under a latency target (``target_tpot_ms``).

Every step of a colocated engine carries the decodes (one token each) and, in what is left
of ``max_num_batched_tokens``, chunks of arriving prompts. A step's time is what each
decoding request waits for its next token, so a long prompt chunk is a TPOT spike for all of
them. With a target, the prompt share of each step is sized so the step takes about the
target: the time of a step is modelled as ``base + cost_per_token * prompt_tokens``, with
``base`` learnt from steps without prompt tokens and ``cost_per_token`` from steps with them
(exponential averages, so the model follows the batch as it grows and shrinks); a step of
prompts alone gives a first, pessimistic, cost per token.

Prompts are never starved: each step still takes at least ``min_prompt_tokens`` of them, and
when nothing decodes the whole budget goes to prompts (there is no TPOT to protect).
"""
from __future__ import annotations

# Weight of the newest observation in the running averages: about the last ten steps count.
SMOOTHING = 0.2
# Steps with fewer prompt tokens than this say little about their per-token cost (noise).
MIN_TOKENS_TO_LEARN = 8


class StepBudget:
    def __init__(self, target_ms: float, max_tokens: int, min_prompt_tokens: int):
        self.target_s = target_ms / 1000.0
        self.max_tokens = max_tokens
        self.min_prompt_tokens = min(min_prompt_tokens, max_tokens)
        self.base_s: float | None = None  # a step of decodes only
        self.cost_per_token_s: float | None = None  # each prompt token on top of it

    def observe(self, num_decodes: int, num_prompt_tokens: int, seconds: float) -> None:
        """One step's composition and how long its forward took."""
        if num_decodes and not num_prompt_tokens:
            self.base_s = _average(self.base_s, seconds)
        elif num_prompt_tokens >= MIN_TOKENS_TO_LEARN:
            # Before any decode-only step the whole step counts as prompt cost: an over-estimate,
            # so the first prompt beside decodes is cut too small rather than too large.
            per_token = max(seconds - (self.base_s or 0.0), 0.0) / num_prompt_tokens
            self.cost_per_token_s = _average(self.cost_per_token_s, per_token)

    def budget(self, num_decodes: int) -> int:
        """Tokens the next step may hold when ``num_decodes`` requests are decoding."""
        if not num_decodes or self.base_s is None or not self.cost_per_token_s:
            return self.max_tokens
        spare = (self.target_s - self.base_s) / self.cost_per_token_s
        prompt_tokens = max(self.min_prompt_tokens, int(spare))
        return max(1, min(self.max_tokens, num_decodes + prompt_tokens))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
