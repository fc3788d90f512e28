"""Draft-model proposals: a small model with the target's vocabulary proposes k tokens, one
forward each, and the target verifies them in one.

The draft has its own KV pool with as many pages as the target's and reads the *target's* block
tables: a request's page i holds its tokens' draft KV in the draft pool and target KV in the
target pool, so the scheduler's allocation (proposal slots included) serves both and nothing
else needs freeing. ``SpecState.draft_computed`` says how much of a request's draft KV is valid;
it starts at 0 for every request, after every preemption and after a KV handoff (the prefill
worker computed only the target's KV), and the draft catches up in one chunked forward. Pages
shared through the prefix cache get their draft KV rewritten with the same values.
"""
from __future__ import annotations

import dataclasses

import torch
from transformers import AutoConfig

from splitserve.engine.config import EngineConfig
from splitserve.engine.model_loader import resolve_model
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.sampler import SamplingRow
from splitserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from splitserve.engine.spec_decode.proposer import Proposer


@dataclasses.dataclass(eq=False)
class _DraftView:
    """What the step inputs read of a request (its id for the block table, its tokens), with the
    draft's proposals appended as they are drawn."""
    request_id: str
    all_token_ids: list[int]


class DraftProposer(Proposer):
    def __init__(self, config: EngineConfig, target: ModelRunner):
        model_dir = resolve_model(config.speculative_model)
        # Checked before loading: the weights of a draft with another vocabulary do not even load.
        draft_vocab, vocab = AutoConfig.from_pretrained(model_dir).vocab_size, target.model.config.vocab_size
        if draft_vocab != vocab:
            raise ValueError(f"speculative_model has a vocabulary of {draft_vocab} tokens, the model {vocab}: "
                             "a draft model must share the model's tokenizer")
        draft_config = dataclasses.replace(
            config, model=config.speculative_model, num_gpu_blocks=target.num_blocks, gpu_memory_utilization=None,
            preemption_mode="recompute", speculative_method=None, speculative_model=None)
        self.runner = ModelRunner(draft_config, model_dir, max_model_len=target.max_model_len)
        self.sampler = target.sampler
        # One forward's token capacity of the draft's input buffers.
        self.max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)

    @torch.inference_mode()
    def _propose(self, chunks: list[ScheduledChunk], plan: SchedulerOutput) -> None:
        views = {c.request.request_id: _DraftView(c.request.request_id, list(c.request.all_token_ids)) for c in chunks}
        spans = [(views[c.request.request_id], min(c.request.spec.draft_computed, c.request.num_tokens - 1))
                 for c in chunks]
        logits = self._forward(spans, plan.block_tables)  # the catch-up: up to each newest token
        drafts: dict[str, list[torch.Tensor]] = {rid: [] for rid in views}
        active = chunks
        for step in range(max(c.lookahead for c in chunks)):
            for chunk, token, q in zip(active, *self._draw(active, [logits[c.request.request_id] for c in active])):
                views[chunk.request.request_id].all_token_ids.append(token)
                drafts[chunk.request.request_id].append(q)
            active = [c for c in active if c.lookahead > step + 1]
            if not active:
                break
            # Feed each newest proposal (its draft KV lands in the slot the target verifies it in).
            logits = self._forward([(views[c.request.request_id], len(views[c.request.request_id].all_token_ids) - 1)
                                    for c in active], plan.block_tables)
        for chunk in chunks:
            request = chunk.request
            view = views[request.request_id]
            chunk.spec_token_ids = view.all_token_ids[request.num_tokens:]
            qs = drafts[request.request_id]
            chunk.draft_probs = None if qs[0] is None else torch.stack(qs)
            # Draft KV now covers every token but the last proposal; update() cuts it back to
            # the accepted run.
            request.spec.draft_computed = len(view.all_token_ids) - 1

    def _forward(self, spans: list[tuple[_DraftView, int]], block_tables: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Draft forward over each view's tokens from its start to its end, in as many forwards
        as the input buffers need; the logits after each view's last token."""
        out: dict[str, torch.Tensor] = {}
        todo = [(view, start) for view, start in spans]
        while todo:
            batch, used, rest = [], 0, []
            for view, start in todo:
                take = min(len(view.all_token_ids) - start, self.max_tokens - used)
                if take <= 0:
                    rest.append((view, start))
                    continue
                done = start + take == len(view.all_token_ids)
                batch.append(ScheduledChunk(view, start, take, samples=done))
                used += take
                if not done:
                    rest.append((view, start + take))
            batch.sort(key=lambda c: not c.is_decode)  # decodes first, as attention backends need
            plan = SchedulerOutput(chunks=batch, block_tables={c.request.request_id: block_tables[c.request.request_id]
                                                              for c in batch})
            logits, sampled = self.runner.logits(plan)
            for row, chunk in enumerate(sampled):
                out[chunk.request.request_id] = logits[row]
            todo = rest
        return out

    def _draw(self, chunks: list[ScheduledChunk], logits: list[torch.Tensor]) -> tuple[list[int], list]:
        """One proposal per chunk and the distribution it was drawn from: the argmax for greedy
        requests (q None: the target verifies them greedily), else a sample from the draft's
        logits under the request's temperature, top-k, top-p and min-p."""
        tokens: list[int] = [0] * len(chunks)
        qs: list = [None] * len(chunks)
        stacked = torch.stack(logits).float()
        greedy = [i for i, c in enumerate(chunks) if c.request.sampling_params.is_greedy]
        if greedy:
            for i, t in zip(greedy, stacked[greedy].argmax(dim=-1).tolist()):
                tokens[i] = t
        random = [i for i, c in enumerate(chunks) if not c.request.sampling_params.is_greedy]
        if random:
            rows = [SamplingRow(chunks[i].request.sampling_params, [], [], chunks[i].request.generator) for i in random]
            q = self.sampler.sampling_probs(stacked[random], rows)
            for j, (i, t) in enumerate(zip(random, self.sampler.draw(q, [r.generator for r in rows]))):
                tokens[i], qs[i] = t, q[j]
        return tokens, qs
