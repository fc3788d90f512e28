"""Paged decode attention for Triton (one new token per sequence), whole or split-KV.

One program per (sequence, KV head) handles the GQA group of query heads that share the KV
head, with an online softmax over the block table. With one partition it normalises and
writes the output itself. A batch of 2 with 8 KV heads is only 16 programs on a GPU with 132
multiprocessors, each walking the whole context: for small batches at long contexts each
context is cut into ``split_len``-token partitions, one program per (sequence, KV head,
partition), each leaving its unnormalised partial result (running max, sum of exponentials,
weighted V) in a float32 scratch buffer; a second kernel merges the partitions of every
(sequence, query head) with the usual log-sum-exp rescaling (flash-decoding). Same semantics
as ``triton_kernels.paged_attention`` for a pure-decode batch, variants included (a window
starts each context later; sinks join the first partition's sums).
"""
from __future__ import annotations

import torch

from splitserve.engine.attention.kv_quant import of_storage
from splitserve.engine.attention.triton_common import (_BLOCK_N, _INTERPRETED, _LOG2E, TRITON_AVAILABLE, _dot, _dot_precision,
                                           _load_kv, _next_pow2, _online_softmax_step, _require_triton, _scale_views,
                                           _sinks_or, _variant_scores, tl, triton)

# Context positions per partition of a split context.
SPLIT_LEN = 512

if TRITON_AVAILABLE:

    @triton.jit
    def _decode_kernel(
        out_ptr,  # [T, Hq, D]: written directly when DIRECT
        part_acc_ptr,  # [B, Hq, S, BLOCK_D] float32 partials otherwise
        part_ml_ptr,  # [B, Hq, S, 2] float32: running max (log2 domain) and sum of exponentials
        q_ptr, k_cache_ptr, v_cache_ptr,
        k_scale_ptr, v_scale_ptr,  # quantized caches as float32 (their scales); else unused
        block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
        scale_log2,
        window, softcap, sinks_ptr,  # the layer's variant: window 0 = none; SOFTCAP / SINKS say the rest
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kc_blk, stride_kc_off, stride_kc_h,
        stride_vc_blk, stride_vc_off, stride_vc_h,
        stride_bt,
        num_splits,
        SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
        GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_LEN: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, DIRECT: tl.constexpr, QUANT: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        row = tl.load(query_start_loc_ptr + b).to(tl.int64)
        ctx_len = tl.load(seq_lens_ptr + b)
        first = 0  # the first position the new token sees
        if window > 0:
            first = tl.maximum(ctx_len - window, 0)
        if DIRECT:
            start = first
            end = ctx_len
        else:
            start = tl.maximum(split * SPLIT_LEN, first)
            end = tl.minimum(split * SPLIT_LEN + SPLIT_LEN, ctx_len)

        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        heads = kvh * GROUP + g
        g_mask = g < GROUP
        d_mask = d < HEAD_DIM
        q_mask = g_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
        if not QUANT:  # quantized pages are dequantized to the query's dtype instead
            q = q.to(k_cache_ptr.dtype.element_ty)

        m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        if SINKS:  # a sink is a score with no value; it joins one partition's sums (the first)
            if DIRECT or split == 0:
                m_i = tl.load(sinks_ptr + heads, mask=g_mask, other=-1.0e30) * 1.4426950408889634
                l_i = tl.where(g_mask, 1.0, 0.0)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        bt_row = block_tables_ptr + b * stride_bt
        for base in range(start, end, BLOCK_N):
            pos = base + n
            p_mask = pos < end
            phys = tl.load(bt_row + pos // BLOCK_SIZE, mask=p_mask, other=0).to(tl.int64)
            off = pos % BLOCK_SIZE
            k = _load_kv(k_cache_ptr, k_scale_ptr, phys * stride_kc_blk + off * stride_kc_off + kvh * stride_kc_h, d,
                         p_mask, HEAD_DIM, QUANT, q_ptr.dtype.element_ty)
            v = _load_kv(v_cache_ptr, v_scale_ptr, phys * stride_vc_blk + off * stride_vc_off + kvh * stride_vc_h, d,
                         p_mask, HEAD_DIM, QUANT, q_ptr.dtype.element_ty)
            s = _variant_scores(_dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT), scale_log2, SOFTCAP, softcap)
            s = tl.where(p_mask[None, :], s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION, UPCAST_DOT)

        if DIRECT:
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
            tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            # A partition past the context leaves max -1e30 and sum 0: it weighs nothing in the merge.
            slot = (b * (GROUP * tl.num_programs(1)) + heads) * num_splits + split
            tl.store(part_acc_ptr + slot[:, None] * BLOCK_D + d[None, :], acc, mask=g_mask[:, None])
            tl.store(part_ml_ptr + slot * 2, m_i, mask=g_mask)
            tl.store(part_ml_ptr + slot * 2 + 1, l_i, mask=g_mask)

    @triton.jit
    def _merge_kernel(
        out_ptr, part_acc_ptr, part_ml_ptr, query_start_loc_ptr,
        stride_ot, stride_oh,
        num_heads, num_splits,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        row = tl.load(query_start_loc_ptr + b).to(tl.int64)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        s_mask = s < num_splits
        slot = (b * num_heads + h) * num_splits + s
        m = tl.load(part_ml_ptr + slot * 2, mask=s_mask, other=-1.0e30)
        l_ = tl.load(part_ml_ptr + slot * 2 + 1, mask=s_mask, other=0.0)
        acc = tl.load(part_acc_ptr + slot[:, None] * BLOCK_D + d[None, :], mask=s_mask[:, None], other=0.0)
        m_max = tl.max(m, 0)
        w = tl.exp2(m - m_max)
        total = tl.sum(l_ * w, 0)
        total = tl.where(total == 0.0, 1.0, total)
        out = tl.sum(acc * w[:, None], 0) / total
        tl.store(out_ptr + row * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def num_splits_for(num_seqs: int, num_kv_heads: int, max_seq_len: int, target_programs: int,
                   split_len: int = SPLIT_LEN) -> int:
    """Partitions per context: enough programs to fill ``target_programs``, none shorter than split_len."""
    busy = num_seqs * num_kv_heads
    if busy >= target_programs:
        return 1
    return max(1, min(-(-max_seq_len // split_len), -(-target_programs // busy)))


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_splits: int = 1,
                 split_len: int = SPLIT_LEN, window: int = 0, softcap: float = 0.0,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention (one new token per sequence); with ``num_splits`` > 1 each context is cut
    into partitions of ``split_len`` positions, and ``num_splits * split_len`` must cover the
    longest context."""
    _require_triton()
    if split_len % _BLOCK_N:
        raise ValueError(f"split_len must be a multiple of {_BLOCK_N}, got {split_len}")
    num_seqs = seq_lens.shape[0]
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_d = max(16, _next_pow2(head_dim))
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    direct = num_splits == 1
    shape = (num_seqs, num_q_heads, num_splits)
    part_acc = out if direct else torch.empty((*shape, block_d), dtype=torch.float32, device=query.device)
    part_ml = out if direct else torch.empty((*shape, 2), dtype=torch.float32, device=query.device)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_acc, part_ml, query, k_cache, v_cache, *_scale_views(k_cache, v_cache), block_tables,
        query_start_loc, seq_lens,
        float(scale) * _LOG2E,
        int(window), float(softcap), _sinks_or(sinks, query),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        num_splits,
        SOFTCAP=bool(softcap), SINKS=sinks is not None,
        GROUP=group, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_G=max(16, _next_pow2(group)),
        BLOCK_D=block_d, BLOCK_N=_BLOCK_N, SPLIT_LEN=split_len,
        DOT_PRECISION=_dot_precision(query, k_cache),
        UPCAST_DOT=_INTERPRETED, DIRECT=direct, QUANT=of_storage(k_cache.dtype) is not None,
    )
    if not direct:
        _merge_kernel[(num_seqs, num_q_heads)](
            out, part_acc, part_ml, query_start_loc, out.stride(0), out.stride(1), num_q_heads, num_splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, _next_pow2(num_splits)),
        )
    return out
