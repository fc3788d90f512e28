"""Paged attention on the CPU: decodes read their pages in place, prefills run one SDPA each.

Decodes go to the C++ kernel in ``csrc/`` (one work item per sequence and KV head, online
softmax over the block table: no context is gathered). A prefill chunk that is its whole
context (no cached prefix, no earlier chunk) attends over its own fresh K/V with causal SDPA;
a chunk after cached context gathers that context once per layer, which costs O(context)
next to the O(chunk x context) of its attention.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import cpu_kernels
from engine.attention.backend import AttentionBackend, StepLayout
from engine.attention.kv_quant import load


@dataclass
class _Chunk:
    q_start: int
    q_end: int
    # The pages of the whole context when the chunk follows cached tokens; None when it is the context.
    ctx_blocks: torch.Tensor | None
    ctx_len: int
    mask: torch.Tensor | None  # [q, ctx] bool, only with ctx_blocks


@dataclass
class CpuStepPlan:
    chunks: list[_Chunk]


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self):
        if not cpu_kernels.available():
            raise RuntimeError("attention_backend='cpu' needs the CPU kernels, which could not be built "
                               f"({cpu_kernels.load_error()}); use attention_backend='torch'")
        self._write_and_decode = torch.ops.splitserve_cpu.write_and_decode

    def prepare(self, layout: StepLayout) -> CpuStepPlan:
        chunks = []
        starts = layout.query_start_list
        for b in range(layout.num_decodes, len(layout.seq_lens_list)):
            q_len, ctx = layout.query_lens_list[b], layout.seq_lens_list[b]
            blocks = mask = None
            if q_len != ctx:
                blocks = layout.block_tables[b, :-(-ctx // layout.block_size)].to(torch.int64)
                q_pos = torch.arange(ctx - q_len, ctx)
                mask = torch.arange(ctx)[None, :] <= q_pos[:, None]
            chunks.append(_Chunk(starts[b], starts[b + 1], blocks, ctx, mask))
        return CpuStepPlan(chunks)

    def forward(self, query, key, value, k_cache, v_cache, layout, prepared: CpuStepPlan, scale):
        # One call writes the step's K/V and attends for every decode: a layer's fixed cost is a
        # few microseconds of dispatch, not a dozen torch calls.
        out = torch.empty(query.shape, dtype=query.dtype)
        self._write_and_decode(out, query, key, value, k_cache, v_cache, layout.slot_mapping, layout.block_tables,
                               layout.seq_lens, layout.num_decodes, scale)
        for c in prepared.chunks:
            q = query[c.q_start:c.q_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
            if c.ctx_blocks is None:
                k, v = key[c.q_start:c.q_end], value[c.q_start:c.q_end]
            else:  # quantized pages (kv_quant) are dequantized here: later chunks see what decode sees
                k, v = (cache[c.ctx_blocks].reshape(-1, *cache.shape[-2:])[:c.ctx_len] for cache in (k_cache, v_cache))
            k = load(k, q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
            v = load(v, q.dtype).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=c.mask, is_causal=c.mask is None, scale=scale,
                                               enable_gqa=True)
            out[c.q_start:c.q_end] = o[0].transpose(0, 1)
        return out
