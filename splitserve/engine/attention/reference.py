"""Plain torch reference implementations of the paged KV-cache operations.

These are written for clarity, not speed: they loop over sequences and gather
the paged K/V into dense tensors before doing ordinary attention.  They define
the semantics that the Triton kernels in ``triton_kernels.py`` must match.

Layout (per layer):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot index s = block_id * block_size + offset

``paged_attention`` arguments (B sequences, T new tokens in total):
    query           [T, num_q_heads, head_dim]   new tokens, flattened
    block_tables    [B, max_blocks_per_seq] int32 logical block -> physical block
    query_start_loc [B + 1] int32                 sequence b owns query rows
                                                  query_start_loc[b]:query_start_loc[b+1]
    seq_lens        [B] int32                     context length INCLUDING the new tokens
    scale           float                         softmax scale (usually head_dim ** -0.5)
    window, softcap, sinks                        a layer's variant (backend.AttentionVariant):
                                                  sliding window, score soft-capping, sinks

Sequence b's new tokens sit at positions ``seq_lens[b] - q_len_b .. seq_lens[b] - 1``
and attend causally to context positions ``0 .. p`` (inclusive), or with a window to
``p - window + 1 .. p``.  Query head h
reads kv head ``h // (num_q_heads // num_kv_heads)``.
"""

from __future__ import annotations

import torch

from splitserve.engine.attention.kv_quant import load, store_rows

__all__ = ["write_kv", "paged_attention", "gather_kv"]


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token t's key/value into slot ``slot_mapping[t]`` of the caches (in place).

    key, value: [T, num_kv_heads, head_dim]; slot_mapping: [T] int64.
    Tokens whose slot is negative are padding and are skipped.
    """
    block_size = k_cache.shape[1]
    for t in range(key.shape[0]):
        slot = int(slot_mapping[t])
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        # A quantized cache (splitserve/engine/attention/kv_quant.py) stores codes + a scale per row.
        k_cache[block, offset] = store_rows(key[t], k_cache.dtype)
        v_cache[block, offset] = store_rows(value[t], v_cache.dtype)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, length: int
) -> torch.Tensor:
    """Return positions 0..length-1 of one sequence as a dense [length, num_kv_heads, head_dim] tensor.

    Only the first ``ceil(length / block_size)`` entries of ``block_table`` are read.
    """
    block_size = cache.shape[1]
    positions = torch.arange(length, device=cache.device)
    logical_blocks = positions // block_size
    offsets = positions % block_size
    physical_blocks = block_table[logical_blocks].long()
    return cache[physical_blocks, offsets]


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens over their paged context.  Returns [T, num_q_heads, head_dim]."""
    num_q_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    assert num_q_heads % num_kv_heads == 0, "num_q_heads must be a multiple of num_kv_heads"
    group = num_q_heads // num_kv_heads

    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        ctx_len = lens[b]
        if q_len == 0:
            continue
        assert q_len <= ctx_len, f"sequence {b}: q_len {q_len} > seq_len {ctx_len}"

        q = query[q_start:q_end].float()                                 # [q_len, Hq, D]
        k = load(gather_kv(k_cache, block_tables[b], ctx_len), torch.float32)  # [ctx, Hkv, D]
        v = load(gather_kv(v_cache, block_tables[b], ctx_len), torch.float32)
        # GQA: query head h uses kv head h // group.
        k = k.repeat_interleave(group, dim=1)                            # [ctx, Hq, D]
        v = v.repeat_interleave(group, dim=1)

        scores = torch.einsum("qhd,khd->hqk", q, k) * scale              # [Hq, q_len, ctx]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
        k_pos = torch.arange(ctx_len, device=query.device)
        visible = k_pos[None, :] <= q_pos[:, None]                       # [q_len, ctx]
        if window:
            visible &= k_pos[None, :] > q_pos[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # a column per head that every row's softmax sees and no value follows
            sink = sinks.float().view(-1, 1, 1).expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
