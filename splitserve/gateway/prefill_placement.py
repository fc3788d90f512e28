"""Where a request's prompt is prefilled: on a prefill worker, whose KV then crosses to the
decode worker, or on the decode worker itself (conditional disaggregation).

Disaggregation pays for itself on long prompts: their prefill would stall every decode of the
decode worker's batch for many steps. A short prompt, or one whose head the decode worker
already caches, costs a decode step little more than its own decodes, while going remote costs
a second worker call, a queue on the prefill worker and a transfer. The policy
(``--disaggregation``):

* ``always``: every prompt on a prefill worker; the decode worker only decodes (the default);
* ``never``: every prompt on its decode worker; a decode worker alone serves, prefill workers
  stand idle;
* ``auto``: per request, by the rule of ``DisaggregationPolicy.decide`` (Dynamo's disaggregated
  router decides on the same two inputs: the prompt left to compute and the prefill queue).

Every decision carries its reason: a label of ``splitserve:prefill_placements_total`` and an
attribute of the request's trace, so an operator can see why a prompt went where it went.
"""
from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("always", "never", "auto")


@dataclass(frozen=True)
class PlacementInputs:
    """What the gateway knows of one request and the decode worker it was placed on."""
    prompt_tokens: int  # the prompt this attempt prefills (with the tokens a retry resumes after)
    cached_tokens: int  # its leading run cached on the decode worker (the prefix directory; any tier)
    step_prompt_budget: int | None  # prompt tokens one of the decode worker's steps takes under its
    #                                 TPOT target beside its decodes (its heartbeat); None: no target
    prefill_queue: float | None  # requests ahead on the cheapest prefill route to that decode worker
    #                              (in flight there, plus the transfer's cost); None: no prefill worker
    local_prefills: int  # prompts of this gateway prefilling on that decode worker now

    @property
    def uncached_tokens(self) -> int:
        """What a local prefill computes."""
        return max(self.prompt_tokens - self.cached_tokens, 0)


@dataclass(frozen=True)
class PrefillPlacement:
    """One decision: where the prompt is prefilled, and why."""
    local: bool  # on the decode worker (else on a prefill worker, then handed off)
    reason: str  # the rule that decided (a metric label; see DisaggregationPolicy.decide)
    uncached_tokens: int  # what the decode worker would compute

    @property
    def where(self) -> str:
        return "local" if self.local else "remote"


@dataclass(frozen=True)
class DisaggregationPolicy:
    disaggregation: str = "always"  # always | never | auto (the flag of the same name)
    local_prefill_tokens: int = 256  # auto: a prompt this short (after the decode worker's cache) stays there
    prefill_queue_limit: float = 0.0  # auto: a prefill route this busy sends a prompt to its decode worker (0: off)

    def __post_init__(self):
        if self.disaggregation not in POLICIES:
            raise ValueError(f"--disaggregation must be one of {', '.join(POLICIES)}, not {self.disaggregation!r}")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"--local-prefill-tokens must be >= 0, got {self.local_prefill_tokens}")
        if self.prefill_queue_limit < 0:
            raise ValueError(f"--prefill-queue-limit must be >= 0 (0: off), got {self.prefill_queue_limit}")

    @property
    def needs_prefill_workers(self) -> bool:
        """A decode-only worker serves only beside a prefill worker."""
        return self.disaggregation == "always"

    def local_limit(self, inputs: PlacementInputs) -> int:
        """The most uncached tokens prefilled locally by the first rule: ``local_prefill_tokens``,
        lowered to what one step of the decode worker takes beside its decodes when it runs
        under a TPOT target (``--target-tpot-ms``): such a prompt then fits one step that keeps
        the target, and the decodes never wait on it."""
        if inputs.step_prompt_budget is None:
            return self.local_prefill_tokens
        return min(self.local_prefill_tokens, inputs.step_prompt_budget)

    def decide(self, inputs: PlacementInputs) -> PrefillPlacement:
        """``auto`` prefills on the decode worker when

        1. ``short_prompt``: what it would compute there (the prompt less its cached head) is
           at most ``local_limit``: less than a transfer and a second worker call cost; or
        2. ``prefill_queue`` (when ``prefill_queue_limit`` is set): the cheapest prefill route has
           that many requests or more ahead, and the decode worker prefills none of this
           gateway's prompts now: the remote prompt would wait longer than a local one takes. One
           at a time per decode worker; still, a long prompt computed there stalls its decodes
           (TPOT p99 1.3-1.9x in the rounds where it fired, on a 1-thread decode worker:
           docs/performance.md), hence off by default: it trades TPOT for TTFT when the
           prefill pool is overloaded; or
        3. ``no_prefill_worker``: there is none to send it to;

        else (``long_prompt``) on a prefill worker."""
        uncached = inputs.uncached_tokens
        if self.disaggregation != "auto":
            return PrefillPlacement(self.disaggregation == "never", self.disaggregation, uncached)
        if inputs.prefill_queue is None:
            return PrefillPlacement(True, "no_prefill_worker", uncached)
        if uncached <= self.local_limit(inputs):
            return PrefillPlacement(True, "short_prompt", uncached)
        if self.prefill_queue_limit and inputs.prefill_queue >= self.prefill_queue_limit \
                and inputs.local_prefills == 0:
            return PrefillPlacement(True, "prefill_queue", uncached)
        return PrefillPlacement(False, "long_prompt", uncached)
