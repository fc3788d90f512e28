"""A host-memory tier below the device KV pool: full prefix pages the pool evicts are kept here,
by their chain hash, and a later prefix hit brings them back instead of computing them again
(vLLM's CPU offloading connector, SGLang's HiCache host tier).

Inclusive: a page brought back stays in the tier too, so evicting it again costs no copy. The
tier is bounded (``--kv-offloading-size`` GiB) and lets its least recently used page go: down to
a disk tier when there is one (``DiskPrefixTier``: a directory of files, one a page, each with a
CRC32 of its key and bytes; ``--kv-offloading-disk-size`` GiB, LRU), else for good. A prefix hit
on a disk page reads its file straight into the device page (a file that does not check out ends
the hit there, and is deleted).

The copies are synchronous, at the moment the pool decides: a page is stored when the pool hands
its page out to another request (before anything can write it), and loaded when a request's
prefix hit takes it (before its step, or a remote prefill's write, can read it). On a CPU the
"device" pool is host memory as well: the tier is a second, bigger-than-the-pool cache there.

Pure Python, like the pool: the copies go through a ``PageCopier`` the model runner provides.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import time
import weakref
import zlib
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol

from splitserve.engine.prefix_holdings import DISK, HOST


class PageCopier(Protocol):
    def store(self, page: int, slot: int) -> None:
        """Copy device page ``page`` into host slot ``slot``."""

    def load(self, slot: int, page: int) -> None:
        """Copy host slot ``slot`` into device page ``page``."""

    def read_slot(self, slot: int) -> bytes:
        """Host slot ``slot``'s bytes (for the disk tier)."""

    def write_page(self, page: int, data: bytes) -> None:
        """Fill device page ``page`` with ``data`` (as ``read_slot`` gave it)."""


@dataclass
class OffloadStats:
    stored: int = 0  # pages copied down into the host tier
    loaded: int = 0  # pages copied back up from it for prefix hits
    dropped: int = 0  # pages it let go to make room (least recently used); to disk when there is one
    disk_stored: int = 0  # pages written to the disk tier
    disk_loaded: int = 0  # pages read back from it (checked) for prefix hits
    disk_dropped: int = 0  # files it deleted to make room
    disk_corrupt: int = 0  # files that did not check out (a miss, deleted)
    load_seconds: float = 0.0  # time spent bringing pages back, both tiers'
    # Of which copying pages from host memory and reading (and checking) disk files: what a page
    # costs from each, which decides whether a load is worth moving beside the step.
    host_copy_seconds: float = 0.0
    disk_read_seconds: float = 0.0

    def page_seconds(self, disk: bool) -> float | None:
        """What a page has cost to bring back from disk (else from host memory), on average;
        None before enough pages came back to say."""
        pages, seconds = (self.disk_loaded, self.disk_read_seconds) if disk else (self.loaded, self.host_copy_seconds)
        return seconds / pages if pages >= MEASURED_PAGES else None

    def by_tier(self) -> dict[tuple[str, str], int]:
        """(tier, op) -> pages, as the workers export them (splitserve:kv_offload_pages)."""
        return {("host", "stored"): self.stored, ("host", "loaded"): self.loaded, ("host", "dropped"): self.dropped,
                ("disk", "stored"): self.disk_stored, ("disk", "loaded"): self.disk_loaded,
                ("disk", "dropped"): self.disk_dropped, ("disk", "corrupt"): self.disk_corrupt}


# Pages a tier must have brought back before its cost per page is trusted.
MEASURED_PAGES = 8

_MAGIC = b"SSKV"


class DiskPrefixTier:
    """Pages in files under ``directory`` (a directory of this tier's own, removed by ``close``):
    ``<hash>.kv`` = magic, CRC32, key length, the key as JSON, the page's bytes. Bounded by
    ``max_bytes``, least recently used file first."""

    def __init__(self, directory: str | Path, max_bytes: int, stats: OffloadStats,
                 on_change: Callable[[int], None] = lambda block_hash: None):
        """``on_change(hash)``: a file came or went (the prefix directory, splitserve/engine/prefix_holdings.py)."""
        self.on_change = on_change
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        # Removed when the tier goes, or at the latest when the process exits normally.
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.directory), True)
        self.max_bytes = max_bytes
        self.stats = stats
        self._files: OrderedDict[int, int] = OrderedDict()  # block hash -> file size, least recent first
        self._bytes = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._files

    def _path(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash & (2**64 - 1):016x}.kv"

    def put(self, block_hash: int, key: tuple, data: bytes) -> None:
        encoded = json.dumps(key).encode()
        body = struct.pack("<I", len(encoded)) + encoded + data
        record = _MAGIC + struct.pack("<I", zlib.crc32(body)) + body
        if len(record) > self.max_bytes:
            return
        self.discard(block_hash)
        while self._bytes + len(record) > self.max_bytes:
            self.discard(next(iter(self._files)))
            self.stats.disk_dropped += 1
        path = self._path(block_hash)
        partial = path.with_suffix(".partial")
        partial.write_bytes(record)
        os.replace(partial, path)  # whole or not at all
        self._files[block_hash] = len(record)
        self._bytes += len(record)
        self.stats.disk_stored += 1
        self.on_change(block_hash)

    def take(self, block_hash: int, key: tuple) -> bytes | None:
        """The page's bytes if its file is there and checks out (its key ``key``); the file is
        deleted either way (the page goes up into the pool, and from there to the host tier)."""
        if block_hash not in self._files:
            return None
        data = self.read(block_hash, key)
        self.taken(block_hash, data is not None)
        return data

    def read(self, block_hash: int, key: tuple) -> bytes | None:
        """The page's bytes if its file checks out, else None; touches no bookkeeping, so the
        loader thread may call it (a file discarded meanwhile reads as missing)."""
        try:
            record = self._path(block_hash).read_bytes()
        except OSError:
            return None
        if len(record) >= 12 and record[:4] == _MAGIC and \
                struct.unpack("<I", record[4:8])[0] == zlib.crc32(record[8:]):
            length = struct.unpack("<I", record[8:12])[0]
            if json.loads(record[12:12 + length]) == json.loads(json.dumps(key)):
                return record[12 + length:]
        return None

    def taken(self, block_hash: int, ok: bool) -> None:
        """A read of ``block_hash``'s file is over (``ok``: it checked out): the file goes."""
        if block_hash not in self._files:
            return  # dropped meanwhile, for room: a miss, not a corrupt file
        self.discard(block_hash)
        if ok:
            self.stats.disk_loaded += 1
        else:
            self.stats.disk_corrupt += 1

    def discard(self, block_hash: int) -> None:
        size = self._files.pop(block_hash, None)
        if size is not None:
            self._bytes -= size
            self._path(block_hash).unlink(missing_ok=True)
            self.on_change(block_hash)

    def close(self) -> None:
        self._cleanup()
        self._files.clear()
        self._bytes = 0


class HostPrefixTier:
    def __init__(self, num_slots: int, copier: PageCopier, disk_dir: str | Path | None = None,
                 disk_bytes: int = 0):
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one page, got {num_slots}")
        self.num_slots = num_slots
        self.copier = copier
        self._free = list(range(num_slots - 1, -1, -1))
        # block hash -> (slot, the exact key behind the hash), least recently used first.
        self._entries: OrderedDict[int, tuple[int, tuple]] = OrderedDict()
        self._pinned: set[int] = set()  # hashes a load is about to read: never dropped
        # Hashes the loader thread is reading (``begin_load``), with how many loads read each.
        self._load_pins: Counter[int] = Counter()
        self._reserved: set[int] = set()  # slots holding swapped-out requests' pages (``SwapSlots``)
        self.stats = OffloadStats()
        # Told the hash of every page that comes or goes, here or on disk (``PrefixHoldings.changed``).
        self.on_change: Callable[[int], None] = lambda block_hash: None
        self.disk = DiskPrefixTier(disk_dir, disk_bytes, self.stats, lambda block_hash: self.on_change(block_hash)) \
            if disk_dir is not None and disk_bytes else None

    def hashes(self) -> list[int]:
        """Every block hash held here or on disk."""
        return [*self._entries, *(self.disk._files if self.disk is not None else ())]

    def tier_of(self, block_hash: int) -> int | None:
        """Where the tier holds a block: ``prefix_holdings.HOST`` and/or ``DISK``, 0 when nowhere."""
        return (HOST if block_hash in self._entries else 0) | \
            (DISK if self.disk is not None and block_hash in self.disk else 0)

    @property
    def num_reserved(self) -> int:
        """Slots holding swapped-out requests' pages."""
        return len(self._reserved)

    def lookup(self, block_hash: int, key: tuple) -> bool:
        """Whether the host tier holds the block (not the disk tier: see ``find``)."""
        entry = self._entries.get(block_hash)
        return entry is not None and entry[1] == key

    def find(self, block_hash: int, key: tuple) -> bool:
        """Whether the block may be loaded: in the host tier (pinned until ``pin(())``), or in a
        file of the disk tier (checked when ``load`` reads it)."""
        if self.lookup(block_hash, key):
            self._pinned.add(block_hash)
            return True
        return self.disk is not None and block_hash in self.disk and block_hash not in self._entries

    def store(self, page: int, block_hash: int, key: tuple) -> None:
        """The pool is giving ``page`` (holding ``block_hash``'s KV) to another request: keep it."""
        if self.lookup(block_hash, key):
            self._entries.move_to_end(block_hash)
            return
        slot = self._free_slot()
        if slot is None:
            return
        self.copier.store(page, slot)
        self._entries[block_hash] = (slot, key)
        self.stats.stored += 1
        self.on_change(block_hash)
        if self.disk is not None:
            self.disk.discard(block_hash)  # an older copy there: the host's is the one kept

    def _free_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash in self._entries:  # least recently used first
            if block_hash not in self._pinned and block_hash not in self._load_pins:
                slot, key = self._entries.pop(block_hash)
                self.stats.dropped += 1
                if self.disk is not None:
                    self.disk.put(block_hash, key, self.copier.read_slot(slot))
                self.on_change(block_hash)
                return slot
        return None

    def pin(self, block_hashes: Iterable[int]) -> None:
        """Keep these entries while the pool makes room for loading them (its evictions store pages
        here, and must not drop the ones about to be read); ``pin(())`` ends it."""
        self._pinned = set(block_hashes)

    def close(self) -> None:
        """Remove the disk tier's files (the worker is going away)."""
        if self.disk is not None:
            self.disk.close()

    def load(self, block_hash: int, key: tuple, page: int) -> bool:
        """Copy ``block_hash``'s KV into device page ``page`` (found just before); False when it
        came from a disk file that did not check out (the page is left unwritten)."""
        start = time.perf_counter()
        entry = self._entries.get(block_hash)
        if entry is not None:
            self._entries.move_to_end(block_hash)
            self.copier.load(entry[0], page)
            self.stats.loaded += 1
            self.stats.host_copy_seconds += time.perf_counter() - start
        else:
            data = self.disk.take(block_hash, key) if self.disk is not None else None
            if data is None:
                return False
            self.copier.write_page(page, data)
            self.stats.disk_read_seconds += time.perf_counter() - start
        self.stats.load_seconds += time.perf_counter() - start
        return True

    # ---- loads overlapped with steps (splitserve/engine/prefix_loads.py) ----------------------
    def begin_load(self, blocks: list[tuple[int, tuple, int]]) -> list[int | None]:
        """On the engine thread, for blocks ``find`` just found, each to go into a device page
        (hash, key, page): where each is read from (its host slot, None: its disk file). The host
        entries stay put until ``end_load``."""
        sources = []
        for block_hash, key, _ in blocks:
            entry = self._entries.get(block_hash)
            if entry is not None and entry[1] == key:
                self._load_pins[block_hash] += 1
                sources.append(entry[0])
            else:
                sources.append(None)
        return sources

    def copy_in(self, blocks: list[tuple[int, tuple, int]], sources: list[int | None]) -> int:
        """On the loader thread: copy the blocks into their pages, in order, up to the first whose
        disk file does not check out (or went meanwhile); returns how many were written."""
        with getattr(self.copier, "side_stream", contextlib.nullcontext)():
            for n, ((block_hash, key, page), slot) in enumerate(zip(blocks, sources)):
                start = time.perf_counter()
                if slot is not None:
                    self.copier.load(slot, page)
                    self.stats.host_copy_seconds += time.perf_counter() - start
                    continue
                data = self.disk.read(block_hash, key) if self.disk is not None else None
                if data is None:
                    return n
                self.copier.write_page(page, data)
                self.stats.disk_read_seconds += time.perf_counter() - start
        return len(blocks)

    def end_load(self, blocks: list[tuple[int, tuple, int]], sources: list[int | None], written: int,
                 seconds: float) -> None:
        """On the engine thread, once ``copy_in`` returned ``written``: the host entries are free to
        go again (and were just used), the disk files read are gone, and it is all counted."""
        for n, ((block_hash, _, _), slot) in enumerate(zip(blocks, sources)):
            if slot is not None:
                self._load_pins[block_hash] -= 1
                if not self._load_pins[block_hash]:
                    del self._load_pins[block_hash]
                if n < written:
                    self.stats.loaded += 1
                    if block_hash in self._entries:
                        self._entries.move_to_end(block_hash)
            elif n <= written and self.disk is not None:
                self.disk.taken(block_hash, n < written)
        self.stats.load_seconds += seconds

    def reserve(self, n: int) -> list[int] | None:
        """``n`` slots for a swapped-out request's pages, out of the cache (its least recently used
        pages make room); None, taking nothing, when fewer than ``n`` can be had."""
        if len(self._free) + sum(1 for h in self._entries if h not in self._pinned and h not in self._load_pins) < n:
            return None
        slots = [self._free_slot() for _ in range(n)]
        self._reserved.update(slots)
        return slots

    def unreserve(self, slots: Iterable[int]) -> None:
        for slot in slots:
            self._reserved.remove(slot)
            self._free.append(slot)

    def check_invariants(self) -> None:
        slots = [slot for slot, _ in self._entries.values()] + self._free + sorted(self._reserved)
        if sorted(slots) != list(range(self.num_slots)):
            raise AssertionError("host KV tier: a slot is lost or held twice")


class SwapSlots:
    """The host tier's slots as the pool swap preemption moves requests into (``BlockPool``'s
    interface, as ``KVCacheManager`` uses it): with a tier, swapped pages and evicted prefix pages
    share its memory, and a swap takes room from the least recently used prefix pages. Its copies
    are the tier's, made at once (``copy_out``, ``copy_in``), not before the next step as the
    plain swap pool's are: a slot given back is the tier's to reuse straight away."""

    def __init__(self, tier: HostPrefixTier):
        self.tier = tier
        self.pages_out = self.pages_in = 0  # pages swapped out and back in so far

    @property
    def num_blocks(self) -> int:
        return self.tier.num_slots

    @property
    def num_free(self) -> int:
        return self.tier.num_slots - self.tier.num_reserved

    def allocate(self, n: int) -> list[int] | None:
        return self.tier.reserve(n)

    def release(self, slots: Iterable[int]) -> None:
        self.tier.unreserve(slots)

    def copy_out(self, pairs: Iterable[tuple[int, int]]) -> None:
        for page, slot in pairs:
            self.tier.copier.store(page, slot)
            self.pages_out += 1

    def copy_in(self, pairs: Iterable[tuple[int, int]]) -> None:
        for slot, page in pairs:
            self.tier.copier.load(slot, page)
            self.pages_in += 1

    def check_invariants(self) -> None:
        self.tier.check_invariants()
