"""The host KV tier in shared memory, one for every worker of a host that serves the same model
with the same KV layout (``--kv-offloading-shared``): a prefix page one worker's pool evicts, any
of them may load (a prefill worker a prefix another prefill worker computed; a decode worker a
prefix without its transfer).

One file in the shared-memory directory, ``splitserve-kvtier-<layout digest>``, mapped by every
worker: a header, a header per slot, then the slots, each one page laid out as the pool's page.
The first worker creates and sizes it (``--kv-offloading-size``), the last one out removes it;
one left by workers that were killed is removed by the next sweep (``sweep_dead_tiers``: a file
nobody holds a lock on).

No lock between processes. A page goes to a slot of its hash's set (``WAYS`` slots; the least
recently used one, or an empty one): the slot is marked being written, the page and its key are
written with a CRC32 of the page, then the slot is marked valid. A reader finds a valid slot with
the hash and the exact key, copies the page out, and uses it only if the copy's CRC32 is the one
the header had before the copy: a slot overwritten meanwhile (by another worker storing another
page there) is a miss, as a torn or corrupt one is, never wrong KV. The cost is a CRC32 over each
page stored and each page loaded (~0.1 ms per 370 KB SmolLM2 page here).

Limits: no disk tier below it yet, no swap preemption into it (recompute), the host tier's
statistics count this worker's stores and loads, and the prefix directory lists what each worker
stored (a page another worker overwrote stays listed until the worker notices: a hint).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import time
import zlib
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from splitserve.common.locality import pool_root
from splitserve.engine.kv_offload import OffloadStats
from splitserve.engine.prefix_holdings import HOST

FILE_PREFIX = "splitserve-kvtier-"
_MAGIC = 0x544B5353  # "SSKT"
_HEADER_BYTES = 4096
_EMPTY, _WRITING, _VALID = 0, 1, 2
# Slots a page's hash may go to: a store evicts the least recently used of them.
WAYS = 8
# How long an opener waits for the creator to lay the file out.
_INIT_TIMEOUT_S = 10.0


def _slot_dtype(block_size: int) -> np.dtype:
    return np.dtype([("state", "<u4"), ("crc", "<u4"), ("hash", "<i8"), ("used", "<f8"), ("has_parent", "<u4"),
                     ("ntok", "<u4"), ("parent", "<i8"), ("tokens", "<i8", (block_size,))], align=True)


def layout_digest(model: str, pool: torch.Tensor, block_size: int) -> str:
    """What two workers must agree on to share pages: the model and the page's shape and dtype."""
    page = pool[:, :, 0]
    text = json.dumps([model, str(pool.dtype), list(page.shape), block_size])
    return hashlib.blake2b(text.encode(), digest_size=10).hexdigest()


class SharedPrefixTier:
    """The ``HostPrefixTier`` interface (splitserve/engine/kv_offload.py) over the shared file."""

    disk = None  # (no disk tier below the shared one yet)

    def __init__(self, pool: torch.Tensor, size_gb: float, block_size: int, digest: str,
                 directory: str | os.PathLike | None = None):
        """``pool``: the device pool (pages along dim 2); ``size_gb``: the file's size if this
        worker creates it (an existing file keeps its own)."""
        self.pool = pool
        self.block_size = block_size
        page = pool[:, :, 0]
        self.page_shape = tuple(page.shape)
        self.page_bytes = page.numel() * pool.element_size()
        self.path = Path(directory or pool_root()) / f"{FILE_PREFIX}{digest}"
        self._slot_dtype = _slot_dtype(block_size)
        self.stats = OffloadStats()
        self.on_change: Callable[[int], None] = lambda block_hash: None
        self._fd = self._open(int(size_gb * 2**30 // self.page_bytes))
        size = os.fstat(self._fd).st_size
        self._map = mmap.mmap(self._fd, size)
        header = np.ndarray((4,), "<u8", self._map, 0)
        self.num_slots = int(header[1])
        self.num_sets = max(1, self.num_slots // WAYS)
        self._slots = np.ndarray((self.num_slots,), self._slot_dtype, self._map, _HEADER_BYTES)
        data_offset = self._data_offset(self.num_slots)
        raw = torch.frombuffer(self._map, dtype=torch.uint8, offset=data_offset,
                               count=self.num_slots * self.page_bytes)
        self._data = raw.view(pool.dtype).view(self.num_slots, *self.page_shape)
        self._staging = torch.empty(self.page_shape, dtype=pool.dtype)  # the loader thread's

    # ---- the file ---------------------------------------------------------------------------
    def _data_offset(self, num_slots: int) -> int:
        headers = _HEADER_BYTES + num_slots * self._slot_dtype.itemsize
        return (headers + 4095) // 4096 * 4096

    def _open(self, num_slots: int) -> int:
        """The file's descriptor with a shared lock held (our stake in it): created and laid out
        here if it does not exist, else opened once its creator has laid it out."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return self._join()
        fcntl.flock(fd, fcntl.LOCK_EX)  # openers wait until the header is written
        if num_slots < WAYS:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise ValueError(f"kv_offloading_size holds fewer than {WAYS} KV pages of {self.page_bytes} bytes")
        os.ftruncate(fd, self._data_offset(num_slots) + num_slots * self.page_bytes)
        with mmap.mmap(fd, _HEADER_BYTES) as m:
            header = np.ndarray((4,), "<u8", m, 0)
            header[1], header[2], header[3] = num_slots, self.page_bytes, self.block_size
            header[0] = _MAGIC  # last: the file is ready
            del header
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    def _join(self) -> int:
        give_up = time.monotonic() + _INIT_TIMEOUT_S
        while True:
            fd = os.open(self.path, os.O_RDWR)
            fcntl.flock(fd, fcntl.LOCK_SH)
            if os.fstat(fd).st_size >= _HEADER_BYTES:
                with mmap.mmap(fd, _HEADER_BYTES) as m:
                    header = np.ndarray((4,), "<u8", m, 0).copy()
                if header[0] == _MAGIC:
                    if (int(header[2]), int(header[3])) != (self.page_bytes, self.block_size):
                        os.close(fd)
                        raise ValueError(f"{self.path} holds pages of another layout")
                    return fd
            os.close(fd)
            if time.monotonic() > give_up:
                raise TimeoutError(f"{self.path} was never laid out by the worker that created it")
            time.sleep(0.01)

    def keep(self, pool) -> int:
        """Store every cached page nobody holds of ``pool`` (a ``BlockPool``): a worker that goes
        leaves its prefix cache to the host's other workers. Returns how many."""
        kept = 0
        for block in pool.blocks:
            if block.block_hash is not None and block.ref_count == 0:
                self.store(block.block_id, block.block_hash, block.hash_key)
                kept += 1
        return kept

    def close(self) -> None:
        """Unmap; the last worker out removes the file."""
        if self._fd < 0:
            return
        self._data = self._slots = None
        self._map.close()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.path.unlink(missing_ok=True)
        except BlockingIOError:
            pass  # others still use it
        os.close(self._fd)
        self._fd = -1

    # ---- slots ------------------------------------------------------------------------------
    def _set(self, block_hash: int) -> range:
        start = (block_hash % self.num_sets) * WAYS
        return range(start, min(start + WAYS, self.num_slots))

    def _key_of(self, slot: int) -> tuple:
        s = self._slots[slot]
        tokens = tuple(int(t) for t in s["tokens"][:int(s["ntok"])])
        return (int(s["parent"]) if s["has_parent"] else None, tokens)

    def _find(self, block_hash: int, key: tuple) -> tuple[int, int] | None:
        """(slot, the page's CRC32) of a valid slot holding exactly ``key``."""
        for slot in self._set(block_hash):
            s = self._slots[slot]
            if s["state"] == _VALID and s["hash"] == block_hash:
                crc = int(s["crc"])
                if self._key_of(slot) == key and self._slots[slot]["state"] == _VALID:
                    return slot, crc
        return None

    def lookup(self, block_hash: int, key: tuple) -> bool:
        return self._find(block_hash, key) is not None

    find = lookup  # (nothing to pin: a read checks what it copied)

    def pin(self, block_hashes: Iterable[int]) -> None:
        pass

    def hashes(self) -> list[int]:
        """Every block hash a valid slot holds (any worker's: each of them can load it)."""
        slots = self._slots
        return [int(h) for h in slots["hash"][slots["state"] == _VALID]]

    def tier_of(self, block_hash: int) -> int | None:
        slots = self._slots
        return HOST if any(slots[s]["state"] == _VALID and slots[s]["hash"] == block_hash
                           for s in self._set(block_hash)) else 0

    def store(self, page: int, block_hash: int, key: tuple) -> None:
        """The pool is giving ``page`` (holding ``block_hash``'s KV) to another request: keep it."""
        found = self._find(block_hash, key)
        if found is not None:
            self._slots[found[0]]["used"] = time.time()
            return
        slots = self._slots
        slot = min(self._set(block_hash), key=lambda s: (slots[s]["state"] == _VALID, slots[s]["used"]))
        dropped = int(slots[slot]["hash"]) if slots[slot]["state"] == _VALID else None
        parent, tokens = key
        slots[slot]["state"] = _WRITING
        self._data[slot].copy_(self.pool[:, :, page])
        record = slots[slot]
        record["crc"] = self._crc(self._data[slot])
        record["hash"], record["used"] = block_hash, time.time()
        record["has_parent"], record["parent"] = parent is not None, parent or 0
        record["ntok"] = len(tokens)
        record["tokens"][:len(tokens)] = tokens
        record["state"] = _VALID
        self.stats.stored += 1
        if dropped is not None:
            self.stats.dropped += 1
            self.on_change(dropped)
        self.on_change(block_hash)

    @staticmethod
    def _crc(page: torch.Tensor) -> int:
        return zlib.crc32(page.view(torch.uint8).numpy())

    def load(self, block_hash: int, key: tuple, page: int) -> bool:
        """Copy ``block_hash``'s KV into device page ``page``; False (the page left as it was) when
        the slot went, or what was copied does not check out."""
        start = time.perf_counter()
        staging = torch.empty(self.page_shape, dtype=self.pool.dtype)
        if not self._copy_out(block_hash, key, staging):
            return False
        self.pool[:, :, page].copy_(staging)
        self.stats.loaded += 1
        self.stats.load_seconds += time.perf_counter() - start
        self.stats.host_copy_seconds += time.perf_counter() - start
        return True

    def _copy_out(self, block_hash: int, key: tuple, staging: torch.Tensor) -> bool:
        found = self._find(block_hash, key)
        if found is None:
            return False
        slot, crc = found
        staging.copy_(self._data[slot])
        if self._crc(staging) != crc:
            return False
        self._slots[slot]["used"] = time.time()
        return True

    # ---- loads overlapped with steps (splitserve/engine/prefix_loads.py) ----------------------
    def begin_load(self, blocks: list[tuple[int, tuple, int]]) -> list[int | None]:
        return [0] * len(blocks)  # (each read checks what it copied; nothing is held)

    def copy_in(self, blocks: list[tuple[int, tuple, int]], sources: list[int | None]) -> int:
        for n, (block_hash, key, page) in enumerate(blocks):
            start = time.perf_counter()
            if not self._copy_out(block_hash, key, self._staging):
                return n
            self.pool[:, :, page].copy_(self._staging)
            self.stats.host_copy_seconds += time.perf_counter() - start
        return len(blocks)

    def end_load(self, blocks: list[tuple[int, tuple, int]], sources: list[int | None], written: int,
                 seconds: float) -> None:
        self.stats.loaded += written
        self.stats.load_seconds += seconds

    def check_invariants(self) -> None:
        if self._slots is None:
            return  # closed
        states = self._slots["state"]
        if not np.isin(states, (_EMPTY, _WRITING, _VALID)).all():
            raise AssertionError(f"{self.path}: a slot in no known state")


def sweep_dead_tiers(directory: str | os.PathLike | None = None) -> list[Path]:
    """Remove shared tiers no live worker holds (their workers were killed): a file whose lock
    nobody holds. Returns what it removed."""
    removed = []
    for path in Path(directory or pool_root()).glob(f"{FILE_PREFIX}*"):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink(missing_ok=True)
            removed.append(path)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
    return removed
