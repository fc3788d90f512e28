"""The two halves every transport implements.

A ``KVReceiver`` lives in the decode worker next to its pool and makes the pool writable by
senders of its kind. A ``KVSender`` lives in the prefill worker, one per decode address, and
copies page runs of its own pool into the decode pool. After ``flush`` returns, every byte
written is in the decode pool (or ``flush`` raised): only then may completion be reported.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Sequence

import torch

from splitserve.engine.attention.page_order import pages_of
from splitserve.kvtransfer.base import KVLayout, TransferDescriptor
from splitserve.kvtransfer.lease import LeaseTable

Run = tuple[int, int, int]  # (src_block, dst_block, num_blocks)


class KVReceiver(abc.ABC):
    name: str

    def __init__(self, pool: torch.Tensor, leases: LeaseTable):
        # ``pool`` is [layers, 2, blocks, block_size, kv_heads, head_dim] (the runner's kv_cache);
        # pages move as bytes, so transports hold it as it lies in memory (page_order.pages_of).
        self.pool = pages_of(pool)
        self.leases = leases

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """What a sender needs to reach this pool."""

    def close(self) -> None:
        pass


class KVSender(abc.ABC):
    name: str

    def __init__(self, address: str, src_pool: torch.Tensor):
        self.address = address
        self.src_pool = pages_of(src_pool)  # as it lies in memory, as KVReceiver.pool
        self.src_layout = KVLayout.of_pool("", src_pool)  # model and ranks filled in from a descriptor
        # Copy operations issued (one per page run per layer per K/V): what coalescing saves.
        self.num_copies = 0
        self.bytes_sent = 0

    def check_layout(self, desc: TransferDescriptor) -> None:
        """Raise LayoutMismatchError unless the descriptor's pages mean what this pool's do."""
        mine = dataclasses.replace(self.src_layout, model=desc.layout.model,
                                   tensor_parallel_size=desc.layout.tensor_parallel_size)
        mine.check_compatible(desc.layout)

    # Whether ``write`` takes a head slice (pools split over different numbers of ranks,
    # splitserve/kvtransfer/head_map.py): transports that copy into a mapped pool.
    reshards = False

    @abc.abstractmethod
    def write(self, desc: TransferDescriptor, layer: int, runs: Sequence[Run], heads=None) -> None:
        """Copy ``runs`` of layer ``layer`` (K and V) from the source pool into the descriptor's pages;
        with ``heads`` (a ``head_map.HeadSlice``), only those KV heads of each page."""

    @abc.abstractmethod
    def flush(self, desc: TransferDescriptor) -> None:
        """Return once every write for ``desc`` is in the decode pool; raise if any was refused."""

    def usable(self) -> bool:
        """False once this sender can carry nothing more (its connection broke, its decode pool is
        gone): the prefill side then opens a new one rather than fail every later transfer."""
        return True

    def close(self) -> None:
        pass
