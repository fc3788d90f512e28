"""Same host, CPU: the decode pool lives in shared memory and the prefill side writes into it.

The decode worker creates its pool as a file under /dev/shm (``torch.from_file(shared=True)``)
plus a small page-owner table beside it. A sender maps both and copies page runs straight
from its own pool into the mapped decode pool: no socket, no intermediate buffer. Before each
run it checks that the destination pages still carry the descriptor's epoch, so a stalled
writer whose lease was released stops at its next copy.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Sequence

import torch

from splitserve.common.locality import POOL_PREFIX, pool_root
from splitserve.kvtransfer.base import StaleEpochError, TransferDescriptor, TransportUnavailableError
from splitserve.kvtransfer.lease import LeaseTable
from splitserve.kvtransfer.page_locks import PageLocks, destination_ranges
from splitserve.kvtransfer.page_copy import copy_runs, page_ids
from splitserve.kvtransfer.transports.base import KVReceiver, KVSender, Run



def _map(path: Path, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)


def create_pool_directory(shape: Sequence[int], dtype: torch.dtype, extra_meta: dict | None = None
                          ) -> tuple[torch.Tensor, Path]:
    """A shared-memory directory with the page-owner table and the pool's metadata."""
    directory = pool_root() / f"{POOL_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    directory.mkdir(mode=0o700)
    owners = _map(directory / "owners", shape[2], torch.int64)
    meta = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), **(extra_meta or {})}
    (directory / "meta.json").write_text(json.dumps(meta))
    return owners, directory


def create_shared_pool(shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, Path]:
    """A zeroed pool and page-owner table in shared memory; returns (pool, owners, directory)."""
    owners, directory = create_pool_directory(shape, dtype)
    pool = _map(directory / "pool", _numel(shape), dtype).view(*shape)
    return pool, owners, directory


def _numel(shape: Sequence[int]) -> int:
    numel = 1
    for n in shape:
        numel *= n
    return numel


def remove_pool_directory(directory: Path) -> None:
    for name in ("pool", "owners", "meta.json"):
        (directory / name).unlink(missing_ok=True)
    try:
        directory.rmdir()
    except OSError:
        pass


class ShmReceiver(KVReceiver):
    name = "shm"

    def __init__(self, pool: torch.Tensor, leases: LeaseTable, directory: Path):
        super().__init__(pool, leases)
        self.directory = directory

    @property
    def address(self) -> str:
        return str(self.directory)

    def close(self) -> None:
        remove_pool_directory(self.directory)


class ShmSender(KVSender):
    name = "shm"

    def __init__(self, address: str, src_pool: torch.Tensor):
        super().__init__(address, src_pool)
        directory = Path(address)
        try:
            meta = json.loads((directory / "meta.json").read_text())
        except OSError as e:
            raise TransportUnavailableError(f"{self.name} pool {address} is not reachable from here ({e}); "
                                            "is the decode worker on this host, sharing /dev/shm?") from e
        self.dst_pool = self._map_pool(directory, meta)
        self.owners = _map(directory / "owners", meta["shape"][2], torch.int64)
        # Held on the destination pages from the epoch check until the bytes landed (page_locks).
        self.locks = PageLocks(directory / "owners")
        self._bytes_per_block = 2 * self.dst_pool[0, 0, 0].numel() * self.dst_pool.element_size()

    def _map_pool(self, directory: Path, meta: dict) -> torch.Tensor:
        return _map(directory / "pool", _numel(meta["shape"]), getattr(torch, meta["dtype"])).view(*meta["shape"])

    def _check_owned(self, desc: TransferDescriptor, dst_blocks: torch.Tensor, when: str) -> None:
        if not bool((self.owners.index_select(0, dst_blocks) == desc.epoch).all()):
            raise StaleEpochError(f"request {desc.request_id!r}: destination pages no longer belong to epoch "
                                  f"{desc.epoch} {when}; the decode side released them")

    def write(self, desc: TransferDescriptor, layer: int, runs: Sequence[Run]) -> None:
        runs = tuple(runs)
        dst_blocks = page_ids(runs)[1]
        held = self.locks.hold_shared(destination_ranges(runs))
        try:
            self._check_owned(desc, dst_blocks, "before the copy")
            self.num_copies += copy_runs(self.src_pool[layer], self.dst_pool[layer], runs)
            self._landed()
        finally:
            self.locks.release(held)
        self.bytes_sent += len(dst_blocks) * self._bytes_per_block

    def _landed(self) -> None:
        """Return once the copies just issued are in the decode pool (shm: they are synchronous stores)."""

    def close(self) -> None:
        self.locks.close()

    def flush(self, desc: TransferDescriptor) -> None:
        # Copies are synchronous stores into the shared mapping: nothing is in flight.
        self._check_owned(desc, torch.tensor(desc.written_block_ids, dtype=torch.int64), "at the flush")
