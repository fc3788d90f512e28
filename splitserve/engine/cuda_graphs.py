"""CUDA graphs of the decode step, one per padded batch size, as vLLM captures them.

A decode step launches a few hundred small kernels; on a GPU their launch cost, not the work,
sets the step time at small batches. At start-up the runner captures the (compiled) forward
of a pure-decode batch for each size in ``capture_sizes`` (1, 2, 4, then multiples of 8 up to
``max_num_seqs``); a later decode step of B sequences replays the graph of the smallest size
>= B, with the rows past B padded: slot -1 (the KV write skips it), context length 0 (the
attention reads nothing), token 0 at position 0. Prefills, mixed steps, steps with a
KV-transfer hook and batches above the largest size run the forward as usual.

What a graph bakes in at capture: the addresses of the runner's persistent input buffers
(every step writes its inputs there, see ``splitserve.engine.step_inputs``) and the attention plan of a
full-length decode batch (split-KV partitions sized for ``max_model_len``), which stays
correct for every shorter context.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from splitserve.engine.attention import AttentionBackend, StepLayout
from splitserve.engine.attention.hf_integration import StepContext, step_context

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], backend: AttentionBackend,
                 kv_caches: list, buffers, max_model_len: int, sizes: list[int]):
        self.forward = forward
        self.backend = backend
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.max_model_len = max_model_len
        self.sizes = sorted(sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_s = 0.0

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a batch of ``num_seqs`` decodes replays, or None past the largest."""
        for size in self.sizes:
            if size >= num_seqs:
                return size
        return None

    def _layout(self, size: int) -> StepLayout:
        ids, pos, slots, qsl, lens, tables, _ = self.buffers.device_tensors
        return StepLayout(slot_mapping=slots[:size], query_start_loc=qsl[:size + 1], seq_lens=lens[:size],
                          block_tables=tables[:size], num_decodes=size, query_lens_list=[1] * size,
                          seq_lens_list=[self.max_model_len] * size, block_size=self.buffers.block_size)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = None
        ids, pos = self.buffers.device_tensors[:2]
        self.buffers.fill_padding(0, max(self.sizes))  # every row is padding while capturing
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            layout = self._layout(size)
            ctx = StepContext(self.backend, layout, self.backend.prepare(layout), self.kv_caches)
            with step_context(ctx):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self.forward(ids[:size], pos[:size])  # warm-up outside the capture
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self.forward(ids[:size], pos[:size])
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start
        log.info("captured CUDA graphs for decode batches %s in %.1f s", self.sizes, self.capture_s)

    def replay(self, num_seqs: int, size: int) -> torch.Tensor:
        """Hidden states of the first ``num_seqs`` rows; the inputs are already in the buffers."""
        self.graphs[size].replay()
        return self.outputs[size][:num_seqs]
