"""Copy page runs of one layer from a source pool into a destination pool, on any devices.

The shm and cuda_ipc senders map the decode pool into their own process and copy into it
directly; this is that copy.

* CPU -> CPU: the ``splitserve_cpu::copy_pages`` kernel (``splitserve/engine/attention/csrc``), one call per
  layer whatever the page table: a streaming copy per page, which beat torch's own copy of one
  contiguous run too (0.76-0.83 vs 1.06 of a 2-thread memcpy, ``bench.kvtransfer``, 4,096 tokens).
  Without the kernel (no compiler): as on a GPU, below.
* One GPU (the single-GPU disaggregated mode, or ranks' pools on one device): one Triton kernel
  per layer (``splitserve.kvtransfer.triton_page_copy``), whatever the page table: each byte is
  read once and written once.
* Otherwise, a few runs: slice copies (one per run, K and V together).
* Many short runs (a fragmented page table) on one device without Triton: a gather and a scatter.
* GPU -> another GPU (compose's pairs put prefill on cuda:0 and decode on cuda:1): ``index_copy_``
  cannot take a source on another device, so the pages are gathered on the source device,
  moved in one peer copy, and scattered on the destination device.

Copies are issued on the calling thread's current stream of each device involved; the caller
decides when they are complete (see ``CudaIpcSender.flush``).
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import torch

from splitserve.engine.attention.kv_quant import as_bytes
from splitserve.engine.attention.page_order import token_view
from splitserve.kvtransfer import triton_page_copy

Run = tuple[int, int, int]  # (src_block, dst_block, num_blocks)

# Past this many runs in one layer, one gathered operation beats a copy call per run.
MAX_RUNS_FOR_SLICE_COPIES = 8


@functools.lru_cache(maxsize=8)
def page_ids(runs: tuple[Run, ...], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(source, destination) ids of every page of ``runs``, in order, as int64 tensors on ``device``.

    Cached: every layer of a transfer comes with the same runs, so the ids are built (and, on a
    GPU, copied to it) once per transfer, not once per layer. Built with numpy: ``torch.tensor``
    of a Python list of 256 ids took ~0.2 ms, the copy of a page run's 3 MB about 0.5 ms."""
    table = np.array(runs, dtype=np.int64).reshape(-1, 3)
    lengths = table[:, 2]
    offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    src = torch.from_numpy(np.repeat(table[:, 0], lengths) + offsets)
    dst = torch.from_numpy(np.repeat(table[:, 1], lengths) + offsets)
    return src.to(device), dst.to(device)


def _native_cpu() -> bool:
    from splitserve.engine.attention import cpu_kernels
    return cpu_kernels.available()


def copy_runs(src: torch.Tensor, dst: torch.Tensor, runs: Sequence[Run]) -> int:
    """``dst[:, d:d+n] = src[:, s:s+n]`` for every run; src/dst are one layer, [2, blocks, ...page].

    Returns the number of copy operations issued (what coalescing and batching save)."""
    if not runs:
        return 0
    runs = tuple(runs)
    src, dst = as_bytes(src), as_bytes(dst)  # fp8 pages as bytes: CPU index_copy_ takes no fp8
    if src.device.type == dst.device.type == "cpu" and _native_cpu():
        torch.ops.splitserve_cpu.copy_pages(src, dst, *page_ids(runs))
        return 1
    same_device = src.device == dst.device
    if same_device and src.device.type == "cuda" and triton_page_copy.supports(src, dst):
        triton_page_copy.copy_pages(src, dst, *page_ids(runs, str(src.device)))
        return 1
    if len(runs) <= MAX_RUNS_FOR_SLICE_COPIES:
        pairs = [(dst[:, d:d + n], src[:, s:s + n]) for s, d, n in runs]
        if same_device:  # one call for every run: per-run copy_ calls cost more in Python than in memory
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
        else:
            for d, s in pairs:
                d.copy_(s, non_blocking=True)
        return len(runs)
    pages = src.index_select(1, page_ids(runs, str(src.device))[0])
    if not same_device:
        pages = pages.to(dst.device, non_blocking=True)
    dst.index_copy_(1, page_ids(runs, str(dst.device))[1], pages)
    return 1


def copy_head_runs(src: torch.Tensor, dst: torch.Tensor, runs: Sequence[Run], heads, src_order: str,
                   dst_order: str) -> int:
    """``copy_runs`` of part of each page: ``heads.count`` KV heads from ``heads.src_start`` of the
    source pages to ``heads.dst_start`` of the destination's (``splitserve.kvtransfer.head_map``:
    pools split over different numbers of ranks). src/dst are one layer as they lie in memory,
    each in its own page order; a head range is strided in a token-major page, so this is a
    strided copy per run (K and V together).
    """
    if not runs:
        return 0
    src = _logical(as_bytes(src), src_order).narrow(3, heads.src_start, heads.count)
    dst = _logical(as_bytes(dst), dst_order).narrow(3, heads.dst_start, heads.count)
    blocking = src.device == dst.device
    for s, d, n in runs:
        dst[:, d:d + n].copy_(src[:, s:s + n], non_blocking=not blocking)
    return len(runs)


def _logical(layer: torch.Tensor, order: str) -> torch.Tensor:
    """One layer's pages ``[2, blocks, ...page]`` seen as ``[2, blocks, block_size, kv_heads, row]``."""
    return token_view(layer.unsqueeze(0), order)[0]
