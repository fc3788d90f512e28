"""The host KV tier's pages (splitserve/engine/kv_offload.py keeps their bookkeeping): a host
tensor laid out as the pool's pages, ``[slots, 2, host pages, ...]``, and the copies between the
two, page by page (``kv_offload.PageCopier``). Pinned on CUDA, so the copies go by DMA."""
from __future__ import annotations

import contextlib

import torch


class HostKVPages:
    def __init__(self, pool: torch.Tensor, size_gb: float):
        """``pool``: the device pool as the runner lays it out (pages along dim 2)."""
        self.pool = pool
        page = pool[:, :, 0]
        self.page_bytes = page.numel() * pool.element_size()
        self.num_slots = int(size_gb * 2**30 // self.page_bytes)
        if self.num_slots < 1:
            raise ValueError(f"kv_offloading_size {size_gb} GiB holds no KV page of {self.page_bytes} bytes")
        self.pages = torch.zeros((*pool.shape[:2], self.num_slots, *pool.shape[3:]), dtype=pool.dtype,
                                 pin_memory=pool.device.type == "cuda")
        # The loader thread's copies (splitserve/engine/prefix_loads.py) go on a stream of their own.
        self._stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None

    @contextlib.contextmanager
    def side_stream(self):
        """Copies made inside go on the loader's CUDA stream, and are done when the block ends."""
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            yield
        self._stream.synchronize()

    def store(self, page: int, slot: int) -> None:
        self.pages[:, :, slot].copy_(self.pool[:, :, page])

    def load(self, slot: int, page: int) -> None:
        # Asynchronous from pinned memory: the slot is not reused before the copy is ordered (a
        # store after it goes on the same stream; the loader's stream is synchronized first).
        self.pool[:, :, page].copy_(self.pages[:, :, slot], non_blocking=True)

    def read_slot(self, slot: int) -> bytes:
        return self.pages[:, :, slot].contiguous().view(torch.uint8).numpy().tobytes()

    def write_page(self, page: int, data: bytes) -> None:
        target = self.pool[:, :, page]
        written = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(target.dtype).view(target.shape)
        target.copy_(written.to(target.device))
