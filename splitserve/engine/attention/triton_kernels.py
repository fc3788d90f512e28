"""Triton kernels for the paged KV cache: KV store, paged decode attention and
varlen (chunked-prefill) paged attention.

Same signatures and semantics as ``splitserve.engine.attention.reference`` (see its module
docstring for the cache layout and argument shapes).

Kernels
-------
``_write_kv_kernel``
    grid (T,): one program per token copies all kv heads of key and value into
    slot ``slot_mapping[t]``; negative slots are masked out (padding).
decode (``triton_decode``)
    grid (B, num_kv_heads[, partitions]): one program per (sequence, kv head)
    handles the whole GQA group of query heads of that sequence's single new
    token, with an online softmax over the paged context, ``BLOCK_N`` positions
    per step; small batches at long contexts split each context (flash-decoding).
``_paged_prefill_kernel``
    grid (cdiv(max_q_len, BLOCK_T), B, num_kv_heads): one program per tile of
    ``BLOCK_T`` new tokens x the whole GQA group (flattened into ``BLOCK_M =
    BLOCK_T * BLOCK_G`` rows), causal online softmax over the paged context up
    to the tile's last position.

Paging: a tile of ``BLOCK_N`` context positions is gathered row by row, each
row looking up its own physical block in the block table, so ``BLOCK_N`` is
independent of the cache block size (any block size works, including 8, which
is below ``tl.dot``'s minimum of 16).  Block-table entries past a sequence's
length are never read (the lookup is masked by the context length).

Dispatch in ``paged_attention``: if every sequence has exactly one new token
(``T == B`` and max q_len == 1) the decode kernel is used; otherwise (prefill,
chunked prefill, prefix-cache hits, mixed decode + prefill batches) the general
varlen kernel runs for the whole batch.  Host work per call: none when the caller passes
``max_q_len`` (the engine does, from its host-side step layout); one ``.item()`` otherwise.

This module imports without triton installed; check ``TRITON_AVAILABLE``
before calling.  With ``TRITON_INTERPRET=1`` set before import, the kernels run
on CPU tensors through the Triton interpreter.
"""

from __future__ import annotations

import torch

from splitserve.engine.attention.kv_quant import head_dim_of, of_storage
from splitserve.engine.attention.triton_common import (_BLOCK_N, _INTERPRETED, _LOG2E, TRITON_AVAILABLE, _dot, _dot_precision,  # noqa: F401
                                           _load_kv, _next_pow2, _online_softmax_step, _require_triton, _scale_views,
                                           _sinks_or, _store_quantized, _variant_scores, tl,
                                           triton)
from splitserve.engine.attention.triton_decode import paged_decode

__all__ = ["TRITON_AVAILABLE", "write_kv", "paged_attention"]

# Target number of (token, head) rows per program of the prefill kernel.
_PREFILL_ROWS = 64


if TRITON_AVAILABLE:

    @triton.jit
    def _write_kv_kernel(
        key_ptr,
        value_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,  # quantized caches: the same memory as float32 (scales); else unused
        v_scale_ptr,
        slot_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_kc_blk,
        stride_kc_off,
        stride_kc_h,
        stride_vc_blk,
        stride_vc_off,
        stride_vc_h,
        num_kv_heads,
        BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        QUANT: tl.constexpr,
        QMAX: tl.constexpr,
        ROUND: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:  # padding token
            return
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE

        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < num_kv_heads) & (d[None, :] < HEAD_DIM)

        k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
        v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
        k_row = blk * stride_kc_blk + off * stride_kc_off + h * stride_kc_h
        v_row = blk * stride_vc_blk + off * stride_vc_off + h * stride_vc_h
        k_dst = k_cache_ptr + k_row[:, None] + d[None, :]
        v_dst = v_cache_ptr + v_row[:, None] + d[None, :]
        if QUANT:  # a row's scale sits after its codes: element row / 4 + HEAD_DIM / 4 of the float32 view
            h_mask = h < num_kv_heads
            _store_quantized(k, k_dst, k_scale_ptr + k_row // 4 + HEAD_DIM // 4, mask, h_mask, QMAX, ROUND)
            _store_quantized(v, v_dst, v_scale_ptr + v_row // 4 + HEAD_DIM // 4, mask, h_mask, QMAX, ROUND)
        else:
            tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _paged_prefill_kernel(
        out_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        v_scale_ptr,
        block_tables_ptr,
        query_start_loc_ptr,
        seq_lens_ptr,
        scale_log2,
        window,  # the layer's variant (see triton_decode): window 0 = none
        softcap,
        sinks_ptr,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_kc_blk,
        stride_kc_off,
        stride_kc_h,
        stride_vc_blk,
        stride_vc_off,
        stride_vc_h,
        stride_bt,
        SOFTCAP: tl.constexpr,
        SINKS: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        QUANT: tl.constexpr,
    ):
        tile = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        kvh = tl.program_id(2).to(tl.int64)

        q_start = tl.load(query_start_loc_ptr + b)
        q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
        tile_start = tile * BLOCK_T
        if tile_start >= q_len:  # this sequence has fewer new tokens than the longest one
            return
        ctx_len = tl.load(seq_lens_ptr + b)
        prefix = ctx_len - q_len  # position of the first new token

        BLOCK_M: tl.constexpr = BLOCK_T * BLOCK_G
        i = tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        tok = tile_start + i // BLOCK_G  # token index within the sequence's new tokens
        g = i % BLOCK_G  # head index within the GQA group
        heads = kvh * GROUP + g
        rows = (q_start + tok).to(tl.int64)
        d_mask = d < HEAD_DIM
        row_mask = (tok < q_len) & (g < GROUP)
        q_mask = row_mask[:, None] & d_mask[None, :]
        q_pos = prefix + tok  # absolute position of each row's token

        q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
        if not QUANT:  # quantized pages are dequantized to the query's dtype instead
            q = q.to(k_cache_ptr.dtype.element_ty)

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if SINKS:  # a sink is a score with no value: the softmax starts from it
            m_i = tl.load(sinks_ptr + heads, mask=g < GROUP, other=-1.0e30) * 1.4426950408889634
            l_i = tl.where(g < GROUP, 1.0, 0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # Causal: the tile's last token sits at position prefix + min(tile_start + BLOCK_T, q_len) - 1.
        kv_end = prefix + tl.minimum(tile_start + BLOCK_T, q_len)
        # With a window, the tile's first token sees nothing before its position - window + 1.
        kv_start = 0
        if window > 0:
            kv_start = tl.maximum(prefix + tile_start - window + 1, 0)
        bt_row = block_tables_ptr + b * stride_bt
        for start in range(kv_start, kv_end, BLOCK_N):
            pos = start + n
            p_mask = pos < kv_end
            phys = tl.load(bt_row + pos // BLOCK_SIZE, mask=p_mask, other=0).to(tl.int64)
            off = pos % BLOCK_SIZE
            k = _load_kv(k_cache_ptr, k_scale_ptr, phys * stride_kc_blk + off * stride_kc_off + kvh * stride_kc_h, d,
                         p_mask, HEAD_DIM, QUANT, q_ptr.dtype.element_ty)
            v = _load_kv(v_cache_ptr, v_scale_ptr, phys * stride_vc_blk + off * stride_vc_off + kvh * stride_vc_h, d,
                         p_mask, HEAD_DIM, QUANT, q_ptr.dtype.element_ty)
            s = _variant_scores(_dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT), scale_log2, SOFTCAP, softcap)
            visible = p_mask[None, :] & (pos[None, :] <= q_pos[:, None])  # [BLOCK_M, BLOCK_N]
            if window > 0:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION, UPCAST_DOT)

        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        acc = acc / l_i[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        f"caches must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
    )
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous"


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
    _require_triton()
    _check_cache(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape
    assert k_cache.shape[2] == num_kv_heads and head_dim_of(k_cache) == head_dim
    quant = of_storage(k_cache.dtype)
    assert slot_mapping.shape[0] == num_tokens
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        *_scale_views(k_cache, v_cache),
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_kv_heads,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_H=_next_pow2(num_kv_heads),
        BLOCK_D=_next_pow2(head_dim),
        QUANT=quant is not None,
        QMAX=quant.qmax if quant else 0.0,
        ROUND=quant is not None and quant.storage == torch.int8,
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens over their paged context.  Returns [T, num_q_heads, head_dim].

    ``window``, ``softcap``, ``sinks``: the layer's variant (``backend.AttentionVariant``).

    ``max_q_len``: the most new tokens of any sequence, when the caller knows it on the host
    (the engine does); otherwise it is read from the device with one ``.item()``.

    Dispatch: all q_len == 1 -> decode kernel; anything else -> varlen prefill kernel.
    Rows of ``query`` not owned by any sequence (beyond ``query_start_loc[-1]``) are left
    uninitialised in the output.
    """
    _require_triton()
    _check_cache(k_cache, v_cache)
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    assert head_dim_of(k_cache) == head_dim, "query and cache head_dim differ"
    assert num_q_heads % num_kv_heads == 0, "num_q_heads must be a multiple of num_kv_heads"
    num_seqs = seq_lens.shape[0]
    assert query_start_loc.shape[0] == num_seqs + 1
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if query.stride(-1) != 1:
        query = query.contiguous()

    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_q_heads // num_kv_heads
    scale_log2 = float(scale) * _LOG2E
    block_d = max(16, _next_pow2(head_dim))
    dot_precision = _dot_precision(query, k_cache)
    common = (
        out,
        query,
        k_cache,
        v_cache,
        *_scale_views(k_cache, v_cache),
        block_tables,
        query_start_loc,
        seq_lens,
        scale_log2,
        int(window),
        float(softcap),
        _sinks_or(sinks, query),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
    )

    if max_q_len is None:
        max_q_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    if num_tokens == num_seqs and max_q_len == 1:
        # Pure decode: every sequence contributes exactly one new token.
        return paged_decode(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, window=window,
                            softcap=softcap, sinks=sinks)

    if max_q_len <= 0:
        return out
    block_g = _next_pow2(group)
    block_t = max(1, _PREFILL_ROWS // block_g)
    # Don't waste rows when no sequence has that many new tokens (keep BLOCK_M >= 16 for tl.dot).
    block_t = max(min(block_t, _next_pow2(max_q_len)), max(1, 16 // block_g))
    grid = (triton.cdiv(max_q_len, block_t), num_seqs, num_kv_heads)
    _paged_prefill_kernel[grid](
        *common,
        SOFTCAP=bool(softcap),
        SINKS=sinks is not None,
        GROUP=group,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_T=block_t,
        BLOCK_G=block_g,
        BLOCK_D=block_d,
        BLOCK_N=_BLOCK_N,
        DOT_PRECISION=dot_precision,
        UPCAST_DOT=_INTERPRETED,
        QUANT=of_storage(k_cache.dtype) is not None,
    )
    return out
