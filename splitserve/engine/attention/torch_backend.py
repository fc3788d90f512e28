"""Paged attention in plain torch: the CPU serving path.

Decodes are batched into two matmuls over their gathered, padded contexts, with the query
heads of a GQA group sharing one K/V head (no repeat); CPU SDPA with a mask and a single
query row was 5x slower. Each prefill chunk gets one SDPA call with a causal mask offset by
its cached context. Index tensors and masks are computed once per step (``prepare``) and
reused by every layer (per window, where layers differ in it).

A layer with soft-capping or sinks (``AttentionVariant``) cannot use SDPA: its prefill chunks
take the same explicit scores -> softmax -> values path as the decodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from splitserve.engine.attention.backend import PLAIN, AttentionBackend, AttentionVariant, StepLayout
from splitserve.engine.attention.kv_quant import as_bytes, head_dim_of, load, store_rows


def visible_mask(q_len: int, ctx: int, window: int, device=None, none_if_causal: bool = True) -> torch.Tensor | None:
    """[q, ctx] bool: which context positions each of a chunk's rows (the last q_len positions)
    sees; None when that is plain causal over the whole context (SDPA's is_causal) and
    ``none_if_causal``."""
    if q_len == ctx and not window and none_if_causal:
        return None
    q_pos = torch.arange(ctx - q_len, ctx, device=device)[:, None]
    k_pos = torch.arange(ctx, device=device)[None, :]
    visible = k_pos <= q_pos
    if window:
        visible &= k_pos > q_pos - window
    return visible


@dataclass
class _Prefill:
    q_start: int
    q_end: int
    ctx_slots: tuple[torch.Tensor, torch.Tensor]  # (page, offset) of each context position, [ctx] int64 each
    # Visibility masks by window (see visible_mask), made on first use.
    masks: dict[int, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int) -> torch.Tensor | None:
        if window not in self.masks:
            ctx = self.ctx_slots[0].shape[0]
            self.masks[window] = visible_mask(self.q_end - self.q_start, ctx, window, self.ctx_slots[0].device)
        return self.masks[window]


@dataclass
class TorchStepPlan:
    # Whole blocks are gathered (a page is one contiguous copy, not block_size small ones).
    decode_blocks: torch.Tensor | None  # [Bd * max_blocks] int64, block tables flattened
    # Decode context lengths [Bd, 1, 1, 1] and the gathered positions [max_blocks * block_size].
    decode_lens: torch.Tensor | None
    decode_positions: torch.Tensor | None
    prefills: list[_Prefill]
    new_slots: tuple[torch.Tensor, torch.Tensor]  # (page, offset) where each new token's K/V goes
    # [Bd, 1, 1, max_blocks * block_size] float32 by window: 0 where a decode sees, -inf elsewhere.
    decode_biases: dict[int, torch.Tensor] = field(default_factory=dict)

    def decode_bias(self, window: int) -> torch.Tensor:
        if window not in self.decode_biases:
            inside = self.decode_positions < self.decode_lens
            if window:
                inside &= self.decode_positions >= self.decode_lens - window
            bias = torch.zeros(inside.shape, dtype=torch.float32, device=inside.device)
            self.decode_biases[window] = bias.masked_fill_(~inside, float("-inf"))
        return self.decode_biases[window]


def softmax_weights(scores: torch.Tensor, bias: torch.Tensor | None, variant: AttentionVariant,
                    sink_shape: tuple[int, ...]) -> torch.Tensor:
    """Softmax of float32 scores [..., ctx] under a layer's variant: soft-capped, masked by ``bias``
    (0 or -inf, broadcast), the sinks (viewed as ``sink_shape``, which broadcasts against the
    scores' [..., 1]) in the denominator."""
    if variant.softcap:
        scores = torch.tanh(scores / variant.softcap) * variant.softcap
    if bias is not None:
        scores = scores + bias
    if variant.sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = variant.sinks.view(sink_shape).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


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
        decode_blocks = decode_lens = positions = None
        if nd:
            num_blocks = -(-max(layout.seq_lens_list[:nd]) // layout.block_size)
            decode_blocks = layout.block_tables[:nd, :num_blocks].to(torch.int64).flatten()
            positions = torch.arange(num_blocks * layout.block_size, device=decode_blocks.device)
            decode_lens = layout.seq_lens[:nd].view(nd, 1, 1, 1)
        prefills = []
        starts = layout.query_start_list
        for b in range(nd, len(layout.seq_lens_list)):
            slots = context_slots(layout.block_tables[b:b + 1], layout.block_size, layout.seq_lens_list[b])[0]
            prefills.append(_Prefill(starts[b], starts[b + 1], page_and_offset(slots, layout.block_size)))
        plan = TorchStepPlan(decode_blocks, decode_lens, positions, prefills,
                             page_and_offset(layout.slot_mapping, layout.block_size))
        if nd:
            plan.decode_bias(0)  # made here, with the step's other index work, for the common layer
        return plan

    def forward(self, query, key, value, k_cache, v_cache, layout, prepared: TorchStepPlan, scale,
                variant: AttentionVariant = PLAIN):
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
            probs = softmax_weights(scores, prepared.decode_bias(variant.window), variant,
                                    (num_kv_heads, group, 1)).to(v.dtype)
            out[:nd] = torch.matmul(probs, v.transpose(1, 2)).view(nd, -1, head_dim)
        for p in prepared.prefills:
            k = load(k_cache[p.ctx_slots], query.dtype)  # [ctx, Hkv, D]
            v = load(v_cache[p.ctx_slots], query.dtype)
            out[p.q_start:p.q_end] = chunk_attention(query[p.q_start:p.q_end], k, v, p.mask(variant.window), scale,
                                                     variant)
        return out


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                    variant: AttentionVariant) -> torch.Tensor:
    """One prefill chunk: q [q, Hq, D] over its context k/v [ctx, Hkv, D] with a visibility mask
    [q, ctx] (None: plain causal over the whole context). -> [q, Hq, D]"""
    if variant.softcap or variant.sinks is not None:
        q_len, num_q_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        qg = q.view(q_len, num_kv_heads, num_q_heads // num_kv_heads, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, q, D]
        scores = torch.matmul(qg, k.permute(1, 2, 0).unsqueeze(1)).float() * scale  # [Hkv, G, q, ctx]
        if mask is None:
            mask = visible_mask(q_len, k.shape[0], 0, q.device, none_if_causal=False)
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=q.device).masked_fill_(~mask, float("-inf"))
        probs = softmax_weights(scores, bias, variant, (num_kv_heads, num_q_heads // num_kv_heads, 1, 1)).to(v.dtype)
        return torch.matmul(probs, v.transpose(0, 1).unsqueeze(1)).permute(2, 0, 1, 3).reshape(q.shape)
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None,
                                       scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
