"""Verification of proposals: which of them the target model keeps, and the token after them.

A chunk with proposals d_1..d_P was fed as [newest token, d_1, .., d_P], so its logits rows
0..P give the target's next-token distribution p_i after d_1..d_i. Row i is processed as the
sampler processes a plain decode whose output already ends in d_1..d_i (penalties, min_tokens
and logprobs see those tokens).

* Greedy requests keep d_{i+1} while it is row i's argmax; the first mismatch is replaced by
  that argmax, and with all kept the last row adds one more: output identical to plain decoding.
* Random requests (rejection sampling, Leviathan et al. 2023): d_{i+1} is kept with probability
  min(1, p_i(d) / q_i(d)) where q_i is the proposer's distribution; the first rejection samples
  from the residual max(0, p_i - q_i) renormalised, and with all kept row P samples from p_P.
  For ngram proposals q_i is a point mass on d: keep d with probability p_i(d), and on rejection
  sample from p_i with d removed. Either way every emitted token is distributed as plain
  sampling from the target would have drawn it.
"""
from __future__ import annotations

import torch

from splitserve.engine.sampler import Sampler, SamplingRow, logprob_entries
from splitserve.engine.scheduler import SampledToken, ScheduledChunk
from splitserve.engine.token_draw import row_uniforms


def verify(sampler: Sampler, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> dict[str, list[SampledToken]]:
    """The new tokens of each chunk (chunk j owns the next 1 + len(spec_token_ids) rows of ``logits``)."""
    rows: list[SamplingRow] = []
    spans: list[tuple[int, int]] = []
    for chunk in chunks:
        r = chunk.request
        spans.append((len(rows), len(chunk.spec_token_ids)))
        for i in range(len(chunk.spec_token_ids) + 1):
            out = r.output_token_ids + chunk.spec_token_ids[:i] if i else r.output_token_ids
            rows.append(SamplingRow(r.sampling_params, r.prompt_token_ids, out, r.generator, r.grammar))
    greedy = [j for j, c in enumerate(chunks) if c.request.sampling_params.is_greedy]
    random = [j for j, c in enumerate(chunks) if not c.request.sampling_params.is_greedy]
    result: dict[str, list[SampledToken]] = {}
    if greedy:
        _verify_greedy(sampler, logits, rows, [chunks[j] for j in greedy], [spans[j] for j in greedy], result)
    if random:
        _verify_random(sampler, logits, rows, [chunks[j] for j in random], [spans[j] for j in random], result)
    return result


def _row_ids(spans: list[tuple[int, int]]) -> list[int]:
    return [first + i for first, n in spans for i in range(n + 1)]


def _verify_greedy(sampler, logits, rows, chunks, spans, result) -> None:
    ids = _row_ids(spans)
    out = sampler(logits[ids] if len(ids) < len(rows) else logits, [rows[i] for i in ids])
    logprobs = out.logprobs or [None] * len(ids)
    at = 0
    for chunk, (_, n) in zip(chunks, spans):
        targets = out.token_ids[at:at + n + 1]
        kept = 0
        while kept < n and chunk.spec_token_ids[kept] == targets[kept]:
            kept += 1
        result[chunk.request.request_id] = [SampledToken(t, lp) for t, lp in
                                            zip(targets[:kept + 1], logprobs[at:at + kept + 1])]
        at += n + 1


def _verify_random(sampler, logits, rows, chunks, spans, result) -> None:
    ids = _row_ids(spans)
    sub_rows = [rows[i] for i in ids]
    work = sampler.prepare(logits[ids], sub_rows)
    p = sampler.sampling_probs(work, sub_rows)
    dev = p.device
    # The proposal each row verifies (-1: the last row of a chunk, which only samples), and the
    # proposer's probability of it (1 for point masses).
    proposal = torch.tensor([c.spec_token_ids[i] if i < n else -1 for c, (_, n) in zip(chunks, spans)
                             for i in range(n + 1)], dtype=torch.long, device=dev)
    has = proposal >= 0
    safe = proposal.clamp(min=0).unsqueeze(1)
    p_d = p.gather(1, safe).squeeze(1)
    q_rows = _draft_rows(chunks, spans, p)
    if q_rows is None:  # point masses: accept with p(d); on rejection, p without d
        accept = p_d
        residual = point_mass_residual(p, safe)
    else:
        q_d = q_rows.gather(1, safe).squeeze(1)
        accept = torch.where(q_d > 0, p_d / q_d.clamp(min=1e-30), torch.ones_like(p_d)).clamp(max=1.0)
        residual = (p - q_rows).clamp_(min=0.0)
    residual = torch.where(has.unsqueeze(1), residual, p)  # the last row samples from p itself
    # p == q (up to rounding) leaves nothing: then rejection had probability ~0; sample from p.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    generators = [r.generator for r in sub_rows]
    u = row_uniforms(generators, sampler.generator, dev, wanted=has.tolist())
    fallback = sampler.draw(residual, generators)
    keep = (u < accept).tolist()
    proposal_l = proposal.tolist()
    tokens_per_chunk = []
    at = 0
    for chunk, (_, n) in zip(chunks, spans):
        kept = 0
        while kept < n and keep[at + kept]:
            kept += 1
        tokens_per_chunk.append(proposal_l[at:at + kept] + [fallback[at + kept]])
        at += n + 1
    _emit(work, sub_rows, chunks, spans, tokens_per_chunk, result)


def point_mass_residual(p: torch.Tensor, proposal: torch.Tensor) -> torch.Tensor:
    """What a rejected point-mass proposal leaves: p with the proposed token ([rows, 1]) removed
    (a test swaps in a wrong rule to show the distribution test catches it)."""
    return p.clone().scatter_(1, proposal, 0.0)


def _draft_rows(chunks, spans, p: torch.Tensor) -> torch.Tensor | None:
    """q per row ([rows, vocab]; zeros on each chunk's last row), or None when every chunk's
    proposals are point masses."""
    if all(c.draft_probs is None for c in chunks):
        return None
    parts = []
    for c, (_, n) in zip(chunks, spans):
        q = c.draft_probs
        if q is None:  # a point mass on each proposal
            q = torch.zeros(n, p.shape[1], device=p.device).scatter_(
                1, torch.tensor(c.spec_token_ids, device=p.device).unsqueeze(1), 1.0)
        parts.append(q.to(p.device, torch.float32))
        parts.append(torch.zeros(1, p.shape[1], device=p.device))
    return torch.cat(parts)


def _emit(work, rows, chunks, spans, tokens_per_chunk, result) -> None:
    lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    entries: dict[int, list] = {}
    if lp_rows:
        # The emitted token's logprob in each row (rows past a chunk's emitted ones are dropped).
        emitted = []
        for toks, (_, n) in zip(tokens_per_chunk, spans):
            emitted += toks + [0] * (n + 1 - len(toks))
        lp = torch.log_softmax(work[lp_rows], dim=-1)
        made = logprob_entries(lp, [emitted[i] for i in lp_rows], [rows[i].params.logprobs for i in lp_rows])
        entries = dict(zip(lp_rows, made))
    at = 0
    for chunk, toks, (_, n) in zip(chunks, tokens_per_chunk, spans):
        result[chunk.request.request_id] = [SampledToken(t, entries.get(at + i)) for i, t in enumerate(toks)]
        at += n + 1
