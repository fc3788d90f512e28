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
plain go to ``csrc/fresh_prefill_amx_cpu.cpp`` instead: its matrix products run on the tiles
(oneDNN's batch-reduce GEMM, as ATen exposes it), a block of query positions times the query
heads of one KV head at a time. One chunk, SmolLM2's heads, 2 Xeon cores with AMX, us (this
kernel / torch's SDPA / the AMX kernel): 36 / 40 / 35 at 32 tokens, 69 / 66 / 57 at 64, 179 / 119 /
113 at 128, 228 / 186 / 138 at 150, 538 / 446 / 246 at 250, 1,913 / 943 / 697 at 512, 7,452 /
2,987 / 2,443 at 1,024, 30,740 / 9,829 / 9,229 at 2,048. Below 32 tokens, and in float32 (no
tiles), this kernel is faster. Where the AMX kernel cannot run (a head size not a multiple of 16,
or the route forced on a CPU without tiles) the fresh chunks go to torch's SDPA.
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

# The longest fresh chunk a step must have for its prefills to leave the paged kernel: for the
# AMX kernel, and for SDPA where the AMX kernel cannot take the layer (see above).
AMX_MIN_TOKENS = 32
SDPA_MIN_TOKENS = 128


def amx_prefill_wanted(dtype: torch.dtype) -> bool:
    """Whether fresh prefill chunks of ``dtype`` are faster in the AMX kernel than in the paged
    prefill kernel: bf16 where the CPU has AMX tiles."""
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

    def fresh_bounds(self) -> list[int]:
        """The first row of each prefill chunk and the end of the last (the AMX kernel's argument)."""
        return self.layout.query_start_list[self.layout.num_decodes:]

    def sdpa_chunks(self) -> list[_Chunk]:
        """The prefill chunks as SDPA calls (quantized pages; fresh chunks the AMX kernel cannot
        take), planned on first use."""
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

    def __init__(self, fresh_prefill: bool | None = None):
        """``fresh_prefill``: send steps whose prefill chunks are all fresh to the AMX kernel (or
        SDPA where it cannot run) rather than the paged prefill kernel; None (the engine's
        choice) where that is faster (``amx_prefill_wanted``, AMX_MIN_TOKENS)."""
        self.fresh_prefill = fresh_prefill
        if not cpu_kernels.available():
            raise RuntimeError("attention_backend='cpu' needs the CPU kernels, which could not be built "
                               f"({cpu_kernels.load_error()}); use attention_backend='torch'")
        self._write_and_decode = torch.ops.splitserve_cpu.write_and_decode
        self._paged_prefill = torch.ops.splitserve_cpu.paged_prefill
        self._fresh_prefill_amx = torch.ops.splitserve_cpu.fresh_prefill_amx
        self._amx = torch.cpu._is_amx_tile_supported()

    def prepare(self, layout: StepLayout) -> CpuStepPlan:
        return CpuStepPlan(layout)

    def forward(self, query, key, value, k_cache, v_cache, layout, prepared: CpuStepPlan, scale,
                variant: AttentionVariant = PLAIN):
        # One call writes the step's K/V and attends for every decode, one more attends for every
        # prefill chunk: a layer's fixed cost is a few microseconds of dispatch.
        out = torch.empty(query.shape, dtype=query.dtype)
        real = layout.query_start_list[-1]
        if real < query.shape[0]:  # padding tokens (step_inputs.InputBuffers.pad_tokens): in no sequence
            out[real:].zero_()
        extra = () if variant.plain else (variant.window, variant.softcap, variant.sinks)
        self._write_and_decode(out, query, key, value, k_cache, v_cache, layout.slot_mapping, layout.block_tables,
                               layout.seq_lens, layout.num_decodes, scale, *extra)
        if not prepared.has_prefills:
            return out
        amx = self._amx_takes(query, key, value)
        fresh = variant.plain and self._fresh_route(query.dtype, prepared, amx)
        if k_cache.dtype in _FLOAT_PAGES and not fresh:
            self._paged_prefill(out, query, k_cache, v_cache, layout.block_tables, layout.query_start_loc,
                                layout.seq_lens, layout.num_decodes, scale, *extra)
            return out
        if fresh and amx:
            self._fresh_prefill_amx(out, query, key, value, prepared.fresh_bounds(), scale)
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

    def _amx_takes(self, query, key, value) -> bool:
        """Whether the AMX kernel can run this layer's fresh chunks: bf16, a head size it tiles
        (a multiple of 16), each head's values contiguous."""
        return (self._amx and query.dtype == key.dtype == value.dtype == torch.bfloat16
                and key.shape == value.shape and key.shape[-1] == query.shape[-1] and query.shape[-1] % 16 == 0
                and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1)

    def _fresh_route(self, dtype: torch.dtype, prepared: CpuStepPlan, amx: bool) -> bool:
        """Whether this step's fresh chunks leave the paged kernel (``amx``: for the AMX kernel)."""
        if self.fresh_prefill is not None:
            return self.fresh_prefill and prepared.longest_fresh_chunk() > 0
        threshold = AMX_MIN_TOKENS if amx else SDPA_MIN_TOKENS
        return amx_prefill_wanted(dtype) and prepared.longest_fresh_chunk() >= threshold
