"""A host-memory tier below the device KV pool: full prefix pages the pool evicts are kept here,
by their chain hash, and a later prefix hit brings them back instead of computing them again
(vLLM's CPU offloading connector, SGLang's HiCache host tier).

Inclusive: a page brought back stays in the tier too, so evicting it again costs no copy. The
tier is bounded (``--kv-offloading-size`` GiB) and lets its least recently used page go.

The copies are synchronous, at the moment the pool decides: a page is stored when the pool hands
its page out to another request (before anything can write it), and loaded when a request's
prefix hit takes it (before its step, or a remote prefill's write, can read it). On a CPU the
"device" pool is host memory as well: the tier is a second, bigger-than-the-pool cache there.

Pure Python, like the pool: the copies go through a ``PageCopier`` the model runner provides.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Protocol


class PageCopier(Protocol):
    def store(self, page: int, slot: int) -> None:
        """Copy device page ``page`` into host slot ``slot``."""

    def load(self, slot: int, page: int) -> None:
        """Copy host slot ``slot`` into device page ``page``."""


@dataclass
class OffloadStats:
    stored: int = 0  # pages copied down into the tier
    loaded: int = 0  # pages copied back up for prefix hits
    dropped: int = 0  # pages the tier let go to make room (least recently used)


class HostPrefixTier:
    def __init__(self, num_slots: int, copier: PageCopier):
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one page, got {num_slots}")
        self.num_slots = num_slots
        self.copier = copier
        self._free = list(range(num_slots - 1, -1, -1))
        # block hash -> (slot, the exact key behind the hash), least recently used first.
        self._entries: OrderedDict[int, tuple[int, tuple]] = OrderedDict()
        self._pinned: frozenset[int] = frozenset()  # hashes a load is about to read: never dropped
        self.stats = OffloadStats()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, block_hash: int, key: tuple) -> bool:
        entry = self._entries.get(block_hash)
        return entry is not None and entry[1] == key

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

    def _free_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash in self._entries:  # least recently used first
            if block_hash not in self._pinned:
                slot, _ = self._entries.pop(block_hash)
                self.stats.dropped += 1
                return slot
        return None

    def pin(self, block_hashes: Iterable[int]) -> None:
        """Keep these entries while the pool makes room for loading them (its evictions store pages
        here, and must not drop the ones about to be read); ``pin(())`` ends it."""
        self._pinned = frozenset(block_hashes)

    def load(self, block_hash: int, page: int) -> None:
        """Copy ``block_hash``'s KV into device page ``page`` (looked up just before)."""
        slot, _ = self._entries[block_hash]
        self._entries.move_to_end(block_hash)
        self.copier.load(slot, page)
        self.stats.loaded += 1

    def check_invariants(self) -> None:
        slots = [slot for slot, _ in self._entries.values()] + self._free
        if sorted(slots) != list(range(self.num_slots)):
            raise AssertionError("host KV tier: a slot is lost or held twice")
