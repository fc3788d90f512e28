"""Proposers fill the proposal slots the scheduler reserved (``ScheduledChunk.lookahead``)."""
from __future__ import annotations

import abc

from splitserve.engine.config import EngineConfig
from splitserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from splitserve.engine.spec_decode.ngram import ngram_propose


class Proposer(abc.ABC):
    def propose(self, plan: SchedulerOutput) -> None:
        """Fill each reserved decode's ``spec_token_ids`` (up to its lookahead; maybe none), then
        make the plan what the runner expects: proposals counted in ``num_tokens``, and decodes
        (plain or speculative: those run as one-token rows, ``splitserve.engine.step_inputs.VerifyRow``)
        ahead of every prefill chunk, as attention backends require."""
        chunks = [c for c in plan.chunks if c.lookahead > 0]
        if not chunks:
            return
        self._propose(chunks, plan)
        for chunk in chunks:
            chunk.num_tokens = 1 + len(chunk.spec_token_ids)
            chunk.lookahead = 0
        plan.chunks.sort(key=lambda c: not (c.is_decode or c.spec_token_ids))  # stable sort

    @abc.abstractmethod
    def _propose(self, chunks: list[ScheduledChunk], plan: SchedulerOutput) -> None:
        """Set ``spec_token_ids`` (and, for sampled proposals, ``draft_probs``) of ``chunks``."""


class NgramProposer(Proposer):
    def __init__(self, config: EngineConfig):
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max

    def _propose(self, chunks: list[ScheduledChunk], plan: SchedulerOutput) -> None:
        for chunk in chunks:
            chunk.spec_token_ids = ngram_propose(chunk.request.all_token_ids, chunk.lookahead, self.n_min, self.n_max)
