"""Which prefix blocks one engine holds, and in which tier, as the cluster's prefix directory in
Redis shows them (workers publish, splitserve/worker/prefix_publisher.py; gateways place requests
by it, splitserve/gateway/prefix_routing.py).

The pool and the tiers below it say only *that* a block changed (``changed(hash)``: registered,
evicted, stored, dropped); ``delta()``, called by the publisher a few times a second, asks where
each changed block is now and returns what differs from what was last published. Changes are
thereby coalesced (a block stored and dropped between two calls costs nothing) and bounded by the
blocks held, however many events happen; ``published`` is the directory's content as it should be,
which a publisher writes whole when Redis lost it.

Pure Python, on the engine's thread like the pool it reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

# The tiers as bits, best first: a block's entry is the set of tiers holding it (a block brought
# back from the host tier is in the pool and still in the tier; a worker sharing that tier can
# load it even while the pool holding it is another worker's).
DEVICE, HOST, DISK = 1, 2, 4


def best_tier(tiers: int) -> int:
    """The best tier of a set of them (its lowest bit)."""
    return tiers & -tiers


@dataclass(frozen=True)
class HoldingsDelta:
    """What the directory must learn since the last ``delta``."""
    # block hash -> the tiers now holding it (new blocks, and blocks that moved tier).
    held: dict[int, int]
    # Blocks no tier holds any more.
    gone: list[int]


class PrefixHoldings:
    def __init__(self, where: Callable[[int], int | None], held: Callable[[], Iterable[int]]):
        """``where(hash)``: the tiers holding a block of the base chain or an adapter's (group 0 of
        the pool, bits), 0 when none does; ``held()``: every block hash held now, in any tier."""
        self.where = where
        self.held = held
        # Off until the first ``delta``, which starts from everything held then: an engine nobody
        # publishes for (offline, or a worker without Redis) must not collect the hash of every
        # block it ever cached.
        self.tracking = False
        self._dirty: set[int] = set()
        # What the directory holds once the last delta is written: block hash -> tiers.
        self.published: dict[int, int] = {}

    def changed(self, block_hash: int) -> None:
        if self.tracking:
            self._dirty.add(block_hash)

    def delta(self) -> HoldingsDelta:
        """What changed since the last call (the first: everything held)."""
        if not self.tracking:
            self.tracking = True
            self._dirty.update(self.held())
        held: dict[int, int] = {}
        gone: list[int] = []
        dirty, self._dirty = self._dirty, set()
        for block_hash in dirty:
            tier = self.where(block_hash) or None
            if tier == self.published.get(block_hash):
                continue
            if tier is None:
                del self.published[block_hash]
                gone.append(block_hash)
            else:
                self.published[block_hash] = held[block_hash] = tier
        return HoldingsDelta(held, gone)
