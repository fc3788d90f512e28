"""Steps 1 and 2 of the sampler (``splitserve.engine.sampler`` gives the order): repetition,
frequency and presence penalties, and min_tokens keeping stop tokens and EOS out. Both read a
row's tokens so far, which is why async scheduling leaves such rows to synchronous steps
(``splitserve.engine.sampler.reads_no_history``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import numpy as np
import torch

from splitserve.engine.token_draw import to_device

if TYPE_CHECKING:
    from splitserve.engine.sampler import SamplingRow

_NEG_INF = float("-inf")


def _ids_tensor(ids: Iterable[int], device) -> torch.Tensor:
    return to_device(list(ids), torch.long, device)


def _flat_indices(token_lists: list, row_ids: list[int], vocab: int, device) -> torch.Tensor:
    """``row * vocab + token`` for every token of ``token_lists[j]`` (row ``row_ids[j]``),
    duplicates kept, ids outside ``[0, vocab)`` dropped.  Built on the CPU, then moved."""
    parts, rows = [], []
    for r, toks in zip(row_ids, token_lists):
        if len(toks):
            parts.append(torch.as_tensor(toks, dtype=torch.long).reshape(-1).cpu())
            rows.append(r)
    if not parts:
        return torch.empty(0, dtype=torch.long, device=device)
    allt = torch.cat(parts) if len(parts) > 1 else parts[0]
    if bool(allt.min() < 0) or bool(allt.max() >= vocab):
        parts = [t[(t >= 0) & (t < vocab)] for t in parts]
    flat = torch.cat([t + r * vocab for r, t in zip(rows, parts)])
    return flat.to(device, non_blocking=True)


def _unique_counts(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique values and their counts.  numpy on the CPU: torch's 1-D sort/unique there
    are slow, and pathologically so when its threads are contended."""
    if flat.device.type == "cpu":
        u, c = np.unique(flat.numpy(), return_counts=True)
        return torch.from_numpy(u), torch.from_numpy(c)
    return torch.unique(flat, return_counts=True)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Apply repetition / frequency / presence penalties in place to float ``logits``
    ([len(rows), vocab]) and return it.

    Sparse: only the (row, token) entries that occur in a penalised row's prompt/output are
    read and written, so the cost is O(number of tokens), not O(batch * vocab).
    Repetition (HF-style) over prompt + output first, then ``-= frequency * count`` and
    ``-= presence`` over output tokens (as vLLM).
    """
    batch, vocab = logits.shape
    pen = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not pen:
        return logits
    if not logits.is_contiguous():
        tmp = logits.contiguous()
        apply_penalties(tmp, rows)
        return logits.copy_(tmp)
    dev = logits.device
    flat_logits = logits.view(-1)

    def per_row(attr: str) -> torch.Tensor:
        return torch.tensor(
            [getattr(r.params, attr) for r in rows], dtype=torch.float32, device=dev
        )

    out_flat = _flat_indices([rows[i].output_token_ids for i in pen], pen, vocab, dev)
    out_u = out_c = None
    if out_flat.numel():
        out_u, out_c = _unique_counts(out_flat)

    rep_rows = [i for i in pen if rows[i].params.repetition_penalty != 1.0]
    if rep_rows:
        rep = per_row("repetition_penalty")
        seen = _flat_indices([rows[i].prompt_token_ids for i in rep_rows], rep_rows, vocab, dev)
        if out_u is not None:
            seen = torch.cat([seen, out_u[rep[out_u // vocab] != 1.0]])
        if seen.numel():
            # Duplicates are harmless: each copy writes the same penalised value.
            r = rep[seen // vocab]
            v = flat_logits[seen]
            flat_logits[seen] = torch.where(v > 0, v / r, v * r)

    if out_u is not None:
        row_u = out_u // vocab
        freq_rows = any(rows[i].params.frequency_penalty != 0.0 for i in pen)
        pres_rows = any(rows[i].params.presence_penalty != 0.0 for i in pen)
        if freq_rows or pres_rows:
            v = flat_logits[out_u]
            if freq_rows:
                v = v - per_row("frequency_penalty")[row_u] * out_c
            if pres_rows:
                v = v - per_row("presence_penalty")[row_u]
            flat_logits[out_u] = v
    return logits


def apply_min_tokens(
    logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: Iterable[int]
) -> torch.Tensor:
    """In place: for rows with ``len(output_token_ids) < min_tokens`` set the row's
    ``stop_token_ids`` and (unless ``ignore_eos``) the EOS ids to -inf.  Ids outside the
    vocabulary are ignored; a row that would be left with no finite logit is left alone."""
    vocab = logits.shape[1]
    eos = list(eos_token_ids)
    r_idx: list[int] = []
    t_idx: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) >= p.min_tokens:
            continue
        ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            ids.update(eos)
        ids = [t for t in ids if 0 <= t < vocab]
        if not ids or len(ids) >= vocab:
            continue
        r_idx.extend([i] * len(ids))
        t_idx.extend(ids)
    if r_idx:
        dev = logits.device
        ri, ti = _ids_tensor(r_idx, dev), _ids_tensor(t_idx, dev)
        saved = logits[ri, ti]
        logits[ri, ti] = _NEG_INF
        # If that left a row with no finite logit (the rest was already -inf), undo it for
        # that row: emitting a stop token early beats sampling from an empty distribution.
        touched = sorted(set(r_idx))
        alive = logits.index_select(0, _ids_tensor(touched, dev)).amax(dim=-1) > _NEG_INF
        if not bool(alive.all()):
            dead = {r for r, ok in zip(touched, alive.tolist()) if not ok}
            undo = _ids_tensor([j for j, r in enumerate(r_idx) if r in dead], dev)
            logits[ri[undo], ti[undo]] = saved[undo]
    return logits
