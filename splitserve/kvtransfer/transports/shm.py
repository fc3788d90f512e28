"""Same host, CPU: the decode pool lives in shared memory and the prefill side writes into it.

The decode worker creates its pool as a file under /dev/shm (``torch.from_file(shared=True)``)
plus a small page-owner table beside it. A sender maps both and copies page runs straight
from its own pool into the mapped decode pool: no socket, no intermediate buffer. Before each
run it checks that the destination pages still carry the descriptor's epoch, so a stalled
writer whose lease was released stops at its next copy.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import uuid
from pathlib import Path
from typing import Sequence

import torch

from splitserve.common.locality import POOL_PREFIX, pid_namespace, pool_root, sweep_dead_pools
from splitserve.kvtransfer.base import StaleEpochError, TransferDescriptor, TransportUnavailableError
from splitserve.kvtransfer.lease import LeaseTable
from splitserve.kvtransfer.page_locks import PageLocks, destination_ranges
from splitserve.kvtransfer.page_copy import copy_head_runs, copy_runs, page_ids
from splitserve.kvtransfer.transports.base import KVReceiver, KVSender, Run

log = logging.getLogger(__name__)



def _map(path: Path, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)


def create_pool_directory(shape: Sequence[int], dtype: torch.dtype, extra_meta: dict | None = None
                          ) -> tuple[torch.Tensor, Path]:
    """A shared-memory directory with the page-owner table and the pool's metadata. Pools that
    dead processes of this namespace left behind are removed first."""
    for stale in sweep_dead_pools():
        log.warning("removed %s: the process that made it is gone", stale)
    directory = pool_root() / f"{POOL_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    directory.mkdir(mode=0o700)
    owners = _map(directory / "owners", shape[2], torch.int64)
    meta = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "pid_namespace": pid_namespace(),
            **(extra_meta or {})}
    (directory / "meta.json").write_text(json.dumps(meta))
    return owners, directory


def create_shared_pool(shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, Path]:
    """A zeroed pool and page-owner table in shared memory; returns (pool, owners, directory).

    The pool's memory is taken and touched here, as a pool of private memory is by
    ``torch.zeros``. Left to the first write, each 4 KiB page was allocated, zeroed and mapped
    inside a prefill step (the write of its K/V): ~1.5-2 ms of a 250-token prompt's prefill on a
    2-core Xeon, every new prompt until the pool has gone round once. And a /dev/shm smaller than
    the pool (a container's 64 MB default) would kill the worker with SIGBUS at the first write
    past it, mid-request; here it is a clear error at start."""
    owners, directory = create_pool_directory(shape, dtype)
    path = directory / "pool"
    nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, nbytes)
            else:  # no fallocate (macOS): the size only; the zeroing below takes the memory
                os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        pool = _map(path, _numel(shape), dtype).view(*shape)
        pool.zero_()  # maps every page now (they are zero already)
    except OSError as e:
        remove_pool_directory(directory)
        raise OSError(e.errno, f"cannot place the {nbytes / 2**30:.2f} GiB KV pool in {directory.parent}: "
                               f"{e.strerror}; give the container more /dev/shm (docker: --shm-size, compose: "
                               "shm_size) or a smaller --kv-cache-memory-gb") from None
    except BaseException:
        remove_pool_directory(directory)
        raise
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


# A descriptor's address is the decode worker's word, and a descriptor crosses the network: the
# sender maps only what a decode worker of this project makes, as its own user, and never
# follows a link (one planted in the directory would have the copy overwrite what it points to).
_POOL_NAME = re.compile(re.escape(POOL_PREFIX) + r"[0-9]+-[0-9a-f]{8}")
_META_MAX_BYTES = 1 << 16
_DTYPES = {"float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"}


class PoolDirectory:
    """A decode pool's directory, opened for a sender after checking that it is one: directly
    under the shared-memory directory, named as ``create_pool_directory`` names them, owned by
    this process's user with mode 0700; its files regular, of that user and of the size the
    metadata implies, each opened without following a link and mapped through that open file."""

    def __init__(self, address: str):
        directory = Path(address)
        if directory.parent != pool_root() or not _POOL_NAME.fullmatch(directory.name):
            raise self._refused(address, f"not a pool directory under {pool_root()}")
        try:
            self.fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise self._refused(address, "a link or not a directory") from e
            raise TransportUnavailableError(f"shm pool {address} is not reachable from here ({e.strerror}); is the "
                                            "decode worker on this host, sharing /dev/shm?") from e
        self.address = address
        st = os.fstat(self.fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
            self.close()
            raise self._refused(address, f"owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}, "
                                         f"not by uid {os.geteuid()} with mode 700")
        try:
            self.meta = self._read_meta()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _refused(address: str, why: str) -> TransportUnavailableError:
        log.warning("refused the shm pool a descriptor names, %r: %s", address, why)
        return TransportUnavailableError(f"shm pool {address!r} refused: {why}")

    def open(self, name: str, size: int | None = None, flags: int = os.O_RDWR) -> int:
        """An open file of the directory's ``name``, checked; the caller closes it."""
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as e:
            raise self._refused(self.address, f"{name}: {e.strerror}") from e
        st = os.fstat(fd)
        why = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
               f"owned by uid {st.st_uid}" if st.st_uid != os.geteuid() else
               f"{st.st_size} bytes, not {size}" if size is not None and st.st_size != size else "")
        if why:
            os.close(fd)
            raise self._refused(self.address, f"{name}: {why}")
        return fd

    def _read_meta(self) -> dict:
        fd = self.open("meta.json", flags=os.O_RDONLY)
        try:
            meta = json.loads(os.read(fd, _META_MAX_BYTES))
        except ValueError as e:
            raise self._refused(self.address, f"meta.json: {e}") from e
        finally:
            os.close(fd)
        shape = meta.get("shape") if isinstance(meta, dict) else None
        if not (isinstance(shape, list) and len(shape) == 6 and all(type(n) is int and n > 0 for n in shape)
                and meta.get("dtype") in _DTYPES):
            raise self._refused(self.address, "meta.json does not describe a KV pool")
        return meta

    def map(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Map ``name`` (exactly ``numel`` elements) through a checked open file of it."""
        fd = self.open(name, numel * torch.empty((), dtype=dtype).element_size())
        try:
            return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=dtype)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ShmSender(KVSender):
    name = "shm"
    reshards = True

    def __init__(self, address: str, src_pool: torch.Tensor):
        super().__init__(address, src_pool)
        directory = PoolDirectory(address)
        try:
            meta = directory.meta
            self.dst_pool = self._map_pool(directory, meta)
            blocks = meta["shape"][2]
            self.owners = directory.map("owners", blocks, torch.int64)
            owners = directory.open("owners", blocks * 8)
            try:  # held on the destination pages from the epoch check until the bytes landed (page_locks)
                self.locks = PageLocks(Path(address) / "owners", fd=owners)
            finally:
                os.close(owners)
        finally:
            directory.close()
        self._bytes_per_block = 2 * self.dst_pool[0, 0, 0].numel() * self.dst_pool.element_size()

    def _map_pool(self, directory: PoolDirectory, meta: dict) -> torch.Tensor:
        shape = meta["shape"]
        return directory.map("pool", _numel(shape), getattr(torch, meta["dtype"])).view(*shape)

    def _check_owned(self, desc: TransferDescriptor, dst_blocks: torch.Tensor, when: str) -> None:
        if not bool((self.owners.index_select(0, dst_blocks) == desc.epoch).all()):
            raise StaleEpochError(f"request {desc.request_id!r}: destination pages no longer belong to epoch "
                                  f"{desc.epoch} {when}; the decode side released them")

    def write(self, desc: TransferDescriptor, layer: int, runs: Sequence[Run], heads=None) -> None:
        runs = tuple(runs)
        dst_blocks = page_ids(runs)[1]
        held = self.locks.hold_shared(destination_ranges(runs))
        try:
            self._check_owned(desc, dst_blocks, "before the copy")
            if heads is None:
                self.num_copies += copy_runs(self.src_pool[layer], self.dst_pool[layer], runs)
            else:  # another split of the heads (head_map): the page's share of this rank
                self.num_copies += copy_head_runs(self.src_pool[layer], self.dst_pool[layer], runs, heads,
                                                  self.src_layout.page_order, desc.layout.page_order)
        except BaseException:
            self._release_when_landed(held, failed=True)
            raise
        self._release_when_landed(held)
        share = 1.0 if heads is None else heads.count / desc.layout.num_kv_heads
        self.bytes_sent += int(len(dst_blocks) * self._bytes_per_block * share)

    def _release_when_landed(self, held: list[tuple[int, int]], failed: bool = False) -> None:
        """Drop a write's page locks once its bytes are in the decode pool (``failed``: the write
        stopped part way, and whatever it issued must land first). shm: the copies are synchronous
        stores, so now."""
        self.locks.release(held)

    def usable(self) -> bool:
        # The decode worker removes its pool directory when it stops (its supervisor, when it is
        # killed); a sender kept on it would hold the whole pool mapped.
        return self.dst_pool is not None and os.path.isdir(self.address)

    def close(self) -> None:
        self.locks.close()
        self.dst_pool = self.owners = None  # the mapping goes with its last reference

    def flush(self, desc: TransferDescriptor) -> None:
        # Copies are synchronous stores into the shared mapping: nothing is in flight.
        self._check_owned(desc, torch.tensor(desc.written_block_ids, dtype=torch.int64), "at the flush")
