"""Paged attention through the Triton kernels (the CUDA serving path).

On CPU the kernels run only under ``TRITON_INTERPRET=1`` (tests); ``select_backend``
never picks this backend for CPU on its own. Everything the launches need from the step
(longest query, longest context, whether every sequence decodes) comes from the host-side
lists of the ``StepLayout``: no launch waits on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.attention import triton_kernels, triton_decode
from splitserve.engine.attention.backend import PLAIN, AttentionBackend, AttentionVariant, StepLayout


@dataclass(frozen=True)
class TritonStepPlan:
    max_q_len: int
    max_seq_len: int
    pure_decode: bool


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self):
        if not triton_kernels.TRITON_AVAILABLE:
            raise RuntimeError("attention_backend='triton' needs the triton package (pip install triton)")
        self._target_programs: dict[torch.device, int] = {}

    def prepare(self, layout: StepLayout) -> TritonStepPlan:
        q_lens = layout.query_lens_list
        return TritonStepPlan(max(q_lens, default=0), max(layout.seq_lens_list, default=0),
                              layout.num_decodes == len(q_lens))

    def _programs_to_fill(self, device: torch.device) -> int:
        """Two programs per multiprocessor keep every one busy (on the interpreter: any number)."""
        if device not in self._target_programs:
            sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
            self._target_programs[device] = 2 * sms
        return self._target_programs[device]

    def forward(self, query, key, value, k_cache, v_cache, layout, prepared: TritonStepPlan, scale,
                variant: AttentionVariant = PLAIN):
        triton_kernels.write_kv(key.contiguous(), value.contiguous(), k_cache, v_cache, layout.slot_mapping)
        query = query.contiguous()
        if prepared.pure_decode:
            splits = triton_decode.num_splits_for(len(layout.seq_lens_list), k_cache.shape[2], prepared.max_seq_len,
                                                    self._programs_to_fill(query.device))
            if splits > 1:
                return triton_decode.paged_decode(query, k_cache, v_cache, layout.block_tables,
                                                  layout.query_start_loc, layout.seq_lens, scale, splits,
                                                  window=variant.window, softcap=variant.softcap, sinks=variant.sinks)
        return triton_kernels.paged_attention(query, k_cache, v_cache, layout.block_tables, layout.query_start_loc,
                                              layout.seq_lens, scale, max_q_len=prepared.max_q_len,
                                              window=variant.window, softcap=variant.softcap, sinks=variant.sinks)
