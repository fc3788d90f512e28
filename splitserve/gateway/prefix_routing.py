"""Where a prompt's prefix is cached, from the cluster's prefix directory in Redis
(splitserve/state/prefixes.py), and what that is worth against load when placing the request.

Every gateway reads the same directory, which the workers themselves keep (SGLang's router and
Dynamo's KV router route on such a view; llm-d's prefix-aware scheduler too). What counts for a
worker is the run of the prompt's leading blocks it holds, by tier: a block on the device saves
its prefill outright, one in host memory or on disk a copy less than that.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from splitserve.engine.block_pool import chain_root, prefix_block_hashes
from splitserve.engine.prefix_holdings import DEVICE, DISK, HOST, best_tier
from splitserve.gateway.ledger import OUTAGE
from splitserve.state import prefixes

log = logging.getLogger(__name__)

# Leading blocks of a prompt looked up (8,192 tokens at 16 a block): past that a hit is long
# enough to decide the placement.
MAX_BLOCKS = 512
# Prompt tokens already cached that are worth one request of load (one request more in flight on
# the worker): on these machines a prefill of ~512 tokens takes about as long as a queued short
# request holds a worker up. A long resent history thus outweighs a small queue, a shared
# 64-token system prompt breaks ties only.
TOKENS_PER_REQUEST = 512.0
# What a cached token saves, by tier: a host or disk page is copied back (a disk page read and
# checked first), which is cheaper than its prefill but not free.
TIER_WEIGHT = {DEVICE: 1.0, HOST: 0.8, DISK: 0.5}


@dataclass(frozen=True)
class CachedRun:
    """The prompt's leading blocks a worker holds, counted by the tier each is in."""
    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def blocks(self) -> int:
        return self.device + self.host + self.disk

    def credit(self, block_size: int) -> float:
        """What the run is worth, in requests of load."""
        tokens = block_size * (TIER_WEIGHT[DEVICE] * self.device + TIER_WEIGHT[HOST] * self.host
                               + TIER_WEIGHT[DISK] * self.disk)
        return tokens / TOKENS_PER_REQUEST


def leading_run(tiers: Sequence[int | None]) -> CachedRun:
    """The run from the first block up to the first one the worker lacks, each block counted in
    the best tier holding it."""
    counts = {DEVICE: 0, HOST: 0, DISK: 0}
    for tier in tiers:
        best = best_tier(tier or 0)
        if best not in counts:
            break
        counts[best] += 1
    return CachedRun(counts[DEVICE], counts[HOST], counts[DISK])


def with_shared_tiers(tiers: dict[str, list[int | None]], shared: dict[str, str]) -> dict[str, list[int | None]]:
    """Each worker's tiers, with the host tier added for the blocks that a worker sharing its host
    tier (same ``shared`` value) has there."""
    in_tier: dict[str, list[int]] = {}
    for worker_id, found in tiers.items():
        if worker_id in shared:
            mine = [(tier or 0) & HOST for tier in found]
            seen = in_tier.setdefault(shared[worker_id], mine)
            if seen is not mine:
                in_tier[shared[worker_id]] = [a | b for a, b in zip(seen, mine)]
    return {worker_id: [(tier or 0) | in_tier[shared[worker_id]][i] if worker_id in shared else tier
                        for i, tier in enumerate(found)]
            for worker_id, found in tiers.items()}


class PrefixRouter:
    def __init__(self, state, block_size: int, enabled: bool = True):
        """``state``: a ``RedisState`` over an asyncio client; ``enabled`` False: placement by load
        alone (``--prefix-routing load``), every lookup empty."""
        self.state = state
        self.block_size = block_size
        self.enabled = enabled

    async def lookup(self, worker_ids: Sequence[str], prompt_token_ids: Sequence[int],
                     lora: str | None = None, shared: dict[str, str] | None = None) -> dict[str, CachedRun]:
        """The cached run of ``prompt_token_ids`` on each of ``worker_ids`` that holds any. An
        adapter's blocks chain from its own root (``chain_root``), as its workers cache them.
        ``shared``: worker id -> the host tier it shares (``--kv-offloading-shared``: its host and
        the tier's file); a block one of them stored in their tier counts for each of them."""
        if not self.enabled or not worker_ids:
            return {}
        hashes = prefix_block_hashes(prompt_token_ids, self.block_size, MAX_BLOCKS,
                                     root=chain_root(lora) if lora else None)
        if not hashes:
            return {}
        try:
            tiers = dict(zip(worker_ids, await prefixes.lookup(self.state, list(worker_ids), hashes)))
        except OUTAGE as e:  # a hint only: the request is placed by load (other errors are bugs)
            log.warning("prefix directory lookup failed (%s); placing by load", e)
            return {}
        if shared:
            tiers = with_shared_tiers(tiers, shared)
        runs = {worker_id: leading_run(found) for worker_id, found in tiers.items()}
        return {worker_id: run for worker_id, run in runs.items() if run.blocks}
