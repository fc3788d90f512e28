"""Paged attention through the Triton kernels (the CUDA serving path).

On CPU the kernels run only under ``TRITON_INTERPRET=1`` (tests); ``select_backend``
never picks this backend for CPU on its own.
"""
from __future__ import annotations

from engine.attention import triton_kernels
from engine.attention.backend import AttentionBackend, StepLayout


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self):
        if not triton_kernels.TRITON_AVAILABLE:
            raise RuntimeError("attention_backend='triton' needs the triton package (pip install triton)")

    def prepare(self, layout: StepLayout) -> None:
        return None  # the kernels read the layout's tensors directly

    def forward(self, query, key, value, k_cache, v_cache, layout, prepared, scale):
        triton_kernels.write_kv(key.contiguous(), value.contiguous(), k_cache, v_cache, layout.slot_mapping)
        return triton_kernels.paged_attention(query.contiguous(), k_cache, v_cache, layout.block_tables,
                                              layout.query_start_loc, layout.seq_lens, scale)
