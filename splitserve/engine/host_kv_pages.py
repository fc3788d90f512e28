"""The host KV tier's pages (splitserve/engine/kv_offload.py keeps their bookkeeping): a host
tensor laid out as the pool's pages, ``[slots, 2, host pages, ...]``, and the copies between the
two, page by page (``kv_offload.PageCopier``). Pinned on CUDA, so the copies go by DMA."""
from __future__ import annotations

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

    def store(self, page: int, slot: int) -> None:
        self.pages[:, :, slot].copy_(self.pool[:, :, page])

    def load(self, slot: int, page: int) -> None:
        self.pool[:, :, page].copy_(self.pages[:, :, slot])

    def read_slot(self, slot: int) -> bytes:
        return self.pages[:, :, slot].contiguous().view(torch.uint8).numpy().tobytes()

    def write_page(self, page: int, data: bytes) -> None:
        target = self.pool[:, :, page]
        written = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(target.dtype).view(target.shape)
        target.copy_(written.to(target.device))
