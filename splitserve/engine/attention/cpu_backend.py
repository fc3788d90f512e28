"""Paged attention on the CPU: decodes and prefills read their pages in place.

Decodes go to the C++ decode kernel in ``csrc/`` (one work item per sequence and KV head, online
softmax over the block table: no context is gathered). Prefill chunks (and multi-token verify
queries) go to the C++ prefill kernel (``csrc/prefill_attention_cpu.cpp``): causal attention of
each chunk over its whole context, cached prefix included, in tiles of query rows against
16-key slices of the pages; one call a layer for all of a step's chunks. Against torch's SDPA on
one chunk (2 AVX-512 Zen 5 cores, SmolLM2's 9 x 64 heads over 3 KV heads): bf16 1.1x at 32
tokens, 2.4-2.6x at 144-256, 1.5x at 1,024, 1.4x at 2,048; fp32 1.3x, 2.2-3.1x, 1.8x, 1.5x.
Quantized pages (kv_quant) keep the SDPA path: each chunk attends over its dequantized context.
Both kernels implement every AttentionVariant (sliding window, soft-capping, sinks).

On a CPU with AMX tiles, bf16 steps whose prefill chunks are all fresh (no cached context) and
plain go to torch's SDPA instead, whose flash kernel multiplies on the tiles: one chunk, SmolLM2's
heads, 2 Xeon cores with AMX (us, this kernel / SDPA): 176 / 120 at 128 tokens, 231 / 190 at 150,
568 / 503 at 250, 2,128 / 1,180 at 512, 7,534 / 3,006 at 1,024, 30,267 / 9,110 at 2,048. Below
128 tokens, and in float32 (no tiles: 1.2-1.7x slower than this kernel), this kernel is faster.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitserve.engine.attention import cpu_kernels
from splitserve.engine.attention.backend import PLAIN, AttentionBackend, AttentionVariant, StepLayout
from splitserve.engine.attention.kv_quant import load
from splitserve.engine.attention.torch_backend import chunk_attention, visible_mask

# Page dtypes the prefill kernel reads; quantized pages go through SDPA.
_FLOAT_PAGES = (torch.float32, torch.bfloat16, torch.float16)

# The longest fresh chunk a step must have for its prefills to go to SDPA on AMX (see above).
SDPA_MIN_TOKENS = 128


def amx_sdpa_wanted(dtype: torch.dtype) -> bool:
    """Whether fresh prefill chunks of ``dtype`` are faster in torch's SDPA than in the kernel:
    bf16 where the CPU has AMX tiles (its flash kernel's GEMMs run on them)."""
    return dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported()


@dataclass
class _Chunk:
    q_start: int
    q_end: int
    # The pages of the whole context when the chunk follows cached tokens; None when it is the context.
    ctx_blocks: torch.Tensor | None
    ctx_len: int


@dataclass
class CpuStepPlan:
    layout: StepLayout
    _sdpa_chunks: list[_Chunk] | None = field(default=None, repr=False)
    _longest_fresh: int | None = field(default=None, repr=False)

    @property
    def has_prefills(self) -> bool:
        return self.layout.num_decodes < len(self.layout.seq_lens_list)

    def longest_fresh_chunk(self) -> int:
        """The most rows of a prefill chunk when every prefill chunk of the step is its whole
        context (nothing cached before it: SDPA can read its K/V from the step's rows); else 0.
        Worked out on the first layer's call."""
        if self._longest_fresh is None:
            layout = self.layout
            chunks = range(layout.num_decodes, len(layout.seq_lens_list))
            fresh = all(layout.query_lens_list[b] == layout.seq_lens_list[b] for b in chunks)
            self._longest_fresh = max((layout.query_lens_list[b] for b in chunks), default=0) if fresh else 0
        return self._longest_fresh

    def sdpa_chunks(self) -> list[_Chunk]:
        """The prefill chunks as SDPA calls (quantized pages, fresh chunks on AMX), planned on first use."""
        if self._sdpa_chunks is None:
            layout, chunks = self.layout, []
            starts = layout.query_start_list
            for b in range(layout.num_decodes, len(layout.seq_lens_list)):
                q_len, ctx = layout.query_lens_list[b], layout.seq_lens_list[b]
                blocks = None
                if q_len != ctx:
                    blocks = layout.block_tables[b, :-(-ctx // layout.block_size)].to(torch.int64)
                chunks.append(_Chunk(starts[b], starts[b + 1], blocks, ctx))
            self._sdpa_chunks = chunks
        return self._sdpa_chunks


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, fresh_prefill_sdpa: bool | None = None):
        """``fresh_prefill_sdpa``: send steps whose prefill chunks are all fresh to SDPA; None
        (the engine's choice) where that is faster (``amx_sdpa_wanted``, SDPA_MIN_TOKENS)."""
        self.fresh_prefill_sdpa = fresh_prefill_sdpa
        if not cpu_kernels.available():
            raise RuntimeError("attention_backend='cpu' needs the CPU kernels, which could not be built "
                               f"({cpu_kernels.load_error()}); use attention_backend='torch'")
        self._write_and_decode = torch.ops.splitserve_cpu.write_and_decode
        self._paged_prefill = torch.ops.splitserve_cpu.paged_prefill

    def prepare(self, layout: StepLayout) -> CpuStepPlan:
        return CpuStepPlan(layout)

    def forward(self, query, key, value, k_cache, v_cache, layout, prepared: CpuStepPlan, scale,
                variant: AttentionVariant = PLAIN):
        # One call writes the step's K/V and attends for every decode, one more attends for every
        # prefill chunk: a layer's fixed cost is a few microseconds of dispatch.
        out = torch.empty(query.shape, dtype=query.dtype)
        extra = () if variant.plain else (variant.window, variant.softcap, variant.sinks)
        self._write_and_decode(out, query, key, value, k_cache, v_cache, layout.slot_mapping, layout.block_tables,
                               layout.seq_lens, layout.num_decodes, scale, *extra)
        if not prepared.has_prefills:
            return out
        if k_cache.dtype in _FLOAT_PAGES and not (variant.plain and self._fresh_to_sdpa(query.dtype, prepared)):
            self._paged_prefill(out, query, k_cache, v_cache, layout.block_tables, layout.query_start_loc,
                                layout.seq_lens, layout.num_decodes, scale, *extra)
            return out
        for c in prepared.sdpa_chunks():
            if c.ctx_blocks is None:
                k, v = key[c.q_start:c.q_end], value[c.q_start:c.q_end]
            else:  # quantized pages (kv_quant) are dequantized here: later chunks see what decode sees
                k, v = (cache[c.ctx_blocks].reshape(-1, *cache.shape[-2:])[:c.ctx_len] for cache in (k_cache, v_cache))
            mask = visible_mask(c.q_end - c.q_start, c.ctx_len, variant.window)  # None when fresh and plain
            out[c.q_start:c.q_end] = chunk_attention(query[c.q_start:c.q_end], load(k, query.dtype),
                                                     load(v, query.dtype), mask, scale, variant)
        return out

    def _fresh_to_sdpa(self, dtype: torch.dtype, prepared: CpuStepPlan) -> bool:
        if self.fresh_prefill_sdpa is not None:
            return self.fresh_prefill_sdpa and prepared.longest_fresh_chunk() > 0
        return amx_sdpa_wanted(dtype) and prepared.longest_fresh_chunk() >= SDPA_MIN_TOKENS
