"""The Triton page-copy kernel of the one-GPU handoff (splitserve/kvtransfer/triton_page_copy.py).

Here it runs interpreted on CPU tensors (``TRITON_INTERPRET=1``, set before triton is imported
unless the environment says otherwise); on a GPU machine the same tests run it compiled on CUDA
tensors, and one more runs it through ``copy_runs`` as the cuda_ipc sender does.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from splitserve.engine.attention.triton_common import TRITON_AVAILABLE  # noqa: E402
from splitserve.kvtransfer.base import coalesce  # noqa: E402
from splitserve.kvtransfer.page_copy import page_ids  # noqa: E402
from splitserve.kvtransfer.triton_page_copy import CHUNK_WORDS, copy_pages, supports  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNS = TRITON_AVAILABLE and (DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
pytestmark = pytest.mark.skipif(not RUNS, reason="Triton on CPU tensors needs TRITON_INTERPRET=1")

BLOCKS = 48


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Compared as bytes: random bytes read as floats hold NaNs, which equal nothing."""
    return t.view(torch.uint8).cpu()


def layer(page: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """One layer of a pool, [2 (K, V), blocks, ...page], random bytes."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (2, BLOCKS, *page, dtype.itemsize), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(2, BLOCKS, *page).to(DEVICE)


def page_sets(count: int = 20) -> dict[str, tuple[list[int], list[int]]]:
    """(source pages, destination pages) as a prefill and a decode pool's tables leave them."""
    rng = random.Random(7)
    return {"contiguous": (list(range(3, 3 + count)), list(range(20, 20 + count))),
            "fragmented": (list(range(count)), list(range(0, 2 * count, 2))),
            "scattered": (rng.sample(range(BLOCKS), count), rng.sample(range(BLOCKS), count))}


@pytest.mark.parametrize("pages", ["contiguous", "fragmented", "scattered"])
@pytest.mark.parametrize("dtype,page", [
    (torch.bfloat16, (8, 3, 64)),  # token-major bf16 pages (GPU pools)
    (torch.float32, (2, 8, 16)),  # head-major fp32
    (torch.float8_e4m3fn, (8, 2, 68)),  # 8-bit pages with their scales, a row of 68 bytes
    (torch.uint8, (3, 1, 7)),  # pages of 21 bytes: not whole words, copied as bytes
])
def test_every_page_lands_and_nothing_else_is_written(pages, dtype, page):
    src, dst = layer(page, dtype, seed=1), layer(page, dtype, seed=2)
    before = dst.clone()
    src_pages, dst_pages = page_sets()[pages]
    src_ids, dst_ids = page_ids(tuple(coalesce(src_pages, dst_pages)), str(src.device))
    copy_pages(src, dst, src_ids, dst_ids)
    assert torch.equal(as_bytes(dst[:, dst_pages]), as_bytes(src[:, src_pages]))
    others = [b for b in range(BLOCKS) if b not in dst_pages]
    assert torch.equal(as_bytes(dst[:, others]), as_bytes(before[:, others]))


def test_a_page_larger_than_one_program_is_copied_whole():
    page = (16, 8, 128)  # 64 KiB of fp32: four programs a page
    assert page[0] * page[1] * page[2] > CHUNK_WORDS
    src, dst = layer(page, torch.float32, seed=3), torch.zeros(2, BLOCKS, *page, device=DEVICE)
    src_ids, dst_ids = page_ids(((5, 40, 3),), str(src.device))
    copy_pages(src, dst, src_ids, dst_ids)
    assert torch.equal(as_bytes(dst[:, 40:43]), as_bytes(src[:, 5:8]))
    assert not dst[:, :40].any() and not dst[:, 43:].any()


def test_pools_laid_out_differently_are_refused_not_misread():
    src = layer((8, 3, 64), torch.bfloat16, seed=4)
    strided = torch.zeros(2, BLOCKS, 8, 6, 64, dtype=torch.bfloat16, device=DEVICE)[:, :, :, :3]  # pages with holes
    smaller = torch.zeros(2, BLOCKS, 8, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    ids = page_ids(((0, 0, 2),), str(src.device))
    for dst in (strided, smaller):
        assert not supports(src, dst)
        with pytest.raises(ValueError, match="contiguous pages of one size"):
            copy_pages(src, dst, *ids)


@pytest.mark.gpu
def test_copy_runs_on_one_gpu_is_one_kernel_per_layer():
    """What the cuda_ipc sender calls for a layer on one GPU: one launch whatever the page table."""
    from splitserve.kvtransfer.page_copy import copy_runs
    src, dst = layer((16, 3, 64), torch.bfloat16, seed=5), layer((16, 3, 64), torch.bfloat16, seed=6)
    for src_pages, dst_pages in page_sets().values():
        assert copy_runs(src, dst, coalesce(src_pages, dst_pages)) == 1
        torch.cuda.synchronize()
        assert torch.equal(as_bytes(dst[:, dst_pages]), as_bytes(src[:, src_pages]))
