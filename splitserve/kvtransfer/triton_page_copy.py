"""One Triton kernel that copies any set of pages of one layer, K and V, from pool to pool.

On one GPU (the single-GPU disaggregated mode: prefill and decode are two processes, the decode
pool mapped here through CUDA IPC) the copy of a layer's pages used to be a slice copy per run,
or, for a fragmented page table, a gather into a temporary and a scatter out of it: every byte
read and written twice, and two launches. The device check measured the handoff at 0.12-0.21 of
a device-to-device copy. This kernel reads each source page once and writes it once, wherever
the pages lie: one launch per layer, one program per (page, K/V, chunk of the page).

Pages are copied as words: a page's bytes are viewed as int32 where their size allows (bf16,
fp32 and quantized pages all do), bytes otherwise. Only pages that are contiguous in memory are
taken (``supports``); the caller keeps its other paths for the rest.
Under ``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors (how the tests check it here).
"""
from __future__ import annotations

import torch

from splitserve.engine.attention.kv_quant import as_bytes
from splitserve.engine.attention.triton_common import TRITON_AVAILABLE, tl, triton

# Words each program moves: 16 KiB of int32 words, a page of most models in one or two programs.
CHUNK_WORDS = 4096

if TRITON_AVAILABLE:

    @triton.jit
    def _copy_pages_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr,
                           src_stride_kv, src_stride_page, dst_stride_kv, dst_stride_page,
                           page_words, CHUNK: tl.constexpr):
        page = tl.program_id(0)
        kv = tl.program_id(1)  # 0: K, 1: V
        chunk = tl.program_id(2)
        src_page = tl.load(src_ids_ptr + page).to(tl.int64)
        dst_page = tl.load(dst_ids_ptr + page).to(tl.int64)
        offsets = chunk * CHUNK + tl.arange(0, CHUNK)
        mask = offsets < page_words
        words = tl.load(src_ptr + kv * src_stride_kv + src_page * src_stride_page + offsets, mask=mask)
        tl.store(dst_ptr + kv * dst_stride_kv + dst_page * dst_stride_page + offsets, words, mask=mask)


def _as_words(layer: torch.Tensor) -> torch.Tensor | None:
    """One layer's pages ``[2, blocks, ...page]`` as ``[2, blocks, words]``, the same memory; None
    when a page is not one contiguous stretch (a view that cannot be taken without a copy)."""
    raw = as_bytes(layer)
    try:
        pages = raw.view(raw.shape[0], raw.shape[1], -1)
    except RuntimeError:
        return None
    if pages.stride(-1) != 1:
        return None
    pages = pages.view(torch.uint8)
    if pages.shape[-1] % 4 == 0 and pages.data_ptr() % 4 == 0 and all(s % 4 == 0 for s in pages.stride()[:2]):
        return pages.view(torch.int32)
    return pages


def supports(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether ``copy_pages`` takes these two layers: Triton, one device for both, pages of the
    same size, each one contiguous stretch of memory."""
    if not TRITON_AVAILABLE or src.device != dst.device:
        return False
    a, b = _as_words(src), _as_words(dst)
    return a is not None and b is not None and a.dtype == b.dtype and a.shape[-1] == b.shape[-1]


def copy_pages(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """``dst[:, dst_ids[i]] = src[:, src_ids[i]]`` for every i, K and V: one launch on the device's
    current stream. src/dst are one layer each ``[2, blocks, ...page]`` (``supports`` says which);
    the ids are int64 tensors on the same device."""
    if not supports(src, dst):
        raise ValueError(f"copy_pages takes two layers on one device with contiguous pages of one size; got "
                         f"{tuple(src.shape)} {src.dtype} on {src.device} and {tuple(dst.shape)} {dst.dtype} on "
                         f"{dst.device}")
    if src_ids.numel() != dst_ids.numel():
        raise ValueError(f"{src_ids.numel()} source pages for {dst_ids.numel()} destination pages")
    if src_ids.numel() == 0:
        return
    s, d = _as_words(src), _as_words(dst)
    page_words = s.shape[-1]
    grid = (src_ids.numel(), 2, triton.cdiv(page_words, CHUNK_WORDS))
    _copy_pages_kernel[grid](s, d, src_ids, dst_ids, s.stride(0), s.stride(1), d.stride(0), d.stride(1),
                             page_words, CHUNK=CHUNK_WORDS)
