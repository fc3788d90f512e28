"""Paged attention in plain torch: the CPU serving path.

Decodes are batched into two matmuls over their gathered, padded contexts, with the query
heads of a GQA group sharing one K/V head (no repeat); CPU SDPA with a mask and a single
query row was 5x slower. Each prefill chunk gets one SDPA call with a causal mask offset by
its cached context. Index tensors and masks are computed once per step (``prepare``) and
reused by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitserve.engine.attention.backend import AttentionBackend, StepLayout
from splitserve.engine.attention.kv_quant import as_bytes, head_dim_of, load, store_rows


@dataclass
class _Prefill:
    q_start: int
    q_end: int
    ctx_slots: tuple[torch.Tensor, torch.Tensor]  # (page, offset) of each context position, [ctx] int64 each
    mask: torch.Tensor | None  # [q, ctx] bool, None when the chunk is the whole context (plain causal)


@dataclass
class TorchStepPlan:
    # Whole blocks are gathered (a page is one contiguous copy, not block_size small ones).
    decode_blocks: torch.Tensor | None  # [Bd * max_blocks] int64, block tables flattened
    decode_bias: torch.Tensor | None  # [Bd, 1, 1, max_blocks * block_size] float32: 0 in context, -inf past it
    prefills: list[_Prefill]
    new_slots: tuple[torch.Tensor, torch.Tensor]  # (page, offset) where each new token's K/V goes


def page_and_offset(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots as (page, offset) index pairs into a [blocks, block_size, ...] cache view: they index
    head-major pages too, which have no flat [blocks * block_size, ...] token view."""
    return slots // block_size, slots % block_size


def context_slots(block_tables: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Slot index of every context position < length, per row of block_tables. [B, length]"""
    offsets = torch.arange(block_size, device=block_tables.device)
    slots = block_tables.to(torch.int64).unsqueeze(-1) * block_size + offsets
    return slots.flatten(1)[:, :length]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, layout: StepLayout) -> TorchStepPlan:
        nd = layout.num_decodes
        decode_blocks = decode_bias = None
        if nd:
            num_blocks = -(-max(layout.seq_lens_list[:nd]) // layout.block_size)
            decode_blocks = layout.block_tables[:nd, :num_blocks].to(torch.int64).flatten()
            ctx = num_blocks * layout.block_size
            positions = torch.arange(ctx, device=decode_blocks.device)
            inside = (positions < layout.seq_lens[:nd, None]).view(nd, 1, 1, ctx)
            decode_bias = torch.zeros(inside.shape, dtype=torch.float32, device=inside.device)
            decode_bias.masked_fill_(~inside, float("-inf"))
        prefills = []
        starts = layout.query_start_list
        for b in range(nd, len(layout.seq_lens_list)):
            q_len, ctx = layout.query_lens_list[b], layout.seq_lens_list[b]
            slots = context_slots(layout.block_tables[b:b + 1], layout.block_size, ctx)[0]
            mask = None
            if q_len != ctx:
                q_pos = torch.arange(ctx - q_len, ctx, device=slots.device)
                mask = torch.arange(ctx, device=slots.device)[None, :] <= q_pos[:, None]
            prefills.append(_Prefill(starts[b], starts[b + 1], page_and_offset(slots, layout.block_size), mask))
        return TorchStepPlan(decode_blocks, decode_bias, prefills,
                             page_and_offset(layout.slot_mapping, layout.block_size))

    def forward(self, query, key, value, k_cache, v_cache, layout, prepared: TorchStepPlan, scale):
        num_kv_heads, head_dim = k_cache.shape[-2], head_dim_of(k_cache)
        # Quantized pools (kv_quant) store codes + scale rows; fp8 has no CPU index_put_, bytes do.
        as_bytes(k_cache).index_put_(prepared.new_slots, as_bytes(store_rows(key, k_cache.dtype)))
        as_bytes(v_cache).index_put_(prepared.new_slots, as_bytes(store_rows(value, v_cache.dtype)))

        out = torch.empty_like(query)
        nd = layout.num_decodes
        if nd:
            group = query.shape[1] // num_kv_heads
            q = query[:nd].view(nd, num_kv_heads, group, head_dim)
            k = load(k_cache.index_select(0, prepared.decode_blocks), query.dtype).reshape(nd, -1, num_kv_heads, head_dim)
            v = load(v_cache.index_select(0, prepared.decode_blocks), query.dtype).reshape(nd, -1, num_kv_heads, head_dim)
            scores = torch.matmul(q, k.permute(0, 2, 3, 1)).float() * scale  # [Bd, Hkv, G, C]
            probs = torch.softmax(scores + prepared.decode_bias, dim=-1).to(v.dtype)
            out[:nd] = torch.matmul(probs, v.transpose(1, 2)).view(nd, -1, head_dim)
        for p in prepared.prefills:
            q = query[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
            k = load(k_cache[p.ctx_slots], query.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
            v = load(v_cache[p.ctx_slots], query.dtype).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, is_causal=p.mask is None,
                                               scale=scale, enable_gqa=True)
            out[p.q_start:p.q_end] = o[0].transpose(0, 1)
        return out
