"""Prefix blocks brought back from the host or disk tier (splitserve/engine/kv_offload.py) on a
thread of their own while the engine's steps go on for other requests (the seed's "KV prefetch").

A waiting request whose cached prefix continues past the pool's pages into the tier (``start``)
does not copy those blocks back in its own admission, holding up the step of everyone running: its
blocks get free pages, held by the load itself (no request owns them; nothing is evicted from under
it), a loader thread copies them in (a host page is a memory copy, a disk page a file read and a
CRC check first), and the request waits ("loading") while steps go on. Once the copy is over
(``finish``, at the start of each schedule) the pages are registered as cached, unreferenced, and
the request's next admission finds them as a device hit. Blocks a load brings are not loaded twice:
a second request that needs them waits for the same load. A disk file that does not check out ends
what is registered there, so its block and the ones after it are computed, never read wrong.

The copies go page by page, as the pool decides them; on CUDA on a stream of the loader's own
(``HostKVPages``), so they overlap the step's kernels as well as its host work. ``load_in_place``
makes the same copies inside an admission instead: a load expected to be quick, a decode worker's
reservation, or every load with ``--no-kv-offloading-overlap``.
"""
from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Sequence

from splitserve.engine.block_pool import BlockPool, chain_hash
from splitserve.engine.kv_offload import HostPrefixTier
from splitserve.engine.openmp import unbind_current_thread
from splitserve.engine.prefix_holdings import HOST, PrefixHoldings

# With nothing else to run, a schedule waits this long at most for a load to end (then steps
# again, empty, and waits again): an idle engine does not spin while a disk tier reads.
IDLE_WAIT_S = 0.05
# A load expected to take less than this (from what pages have cost so far) is made in the
# admission instead: it holds the step up less than waiting for the next step would cost the
# request (on a 2-core Zen 5 a 370 KB page from host memory costs ~0.15 ms beside a step, so up to
# ~60 pages, ~1,000 tokens at 16 a page; a step there is ~50 ms).
INLINE_LOAD_S = 0.01


@dataclass
class PendingLoad:
    """One load: made on the engine thread, copied by the loader, ended on the engine thread."""
    # (block hash, exact key, device page), in chain order.
    blocks: list[tuple[int, tuple, int]]
    # Each block's source: its host tier slot, or None for its disk file.
    sources: list[int | None]
    # The device pages of the prefix before these blocks: held (a reference) until the load ends,
    # so that making room for the load, or anything else meanwhile, does not evict them.
    head: list[int] = field(default_factory=list)
    # How many blocks (from the first) the loader wrote.
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    started: float = field(default_factory=time.perf_counter)


def load_in_place(pool: BlockPool, tier: HostPrefixTier, holdings: PrefixHoldings, block_size: int,
                  token_ids: Sequence[int], chain: list[tuple[int, tuple]], hit: list[int], max_blocks: int,
                  root: int | None) -> list[int]:
    """In a request's admission (``KVCacheManager.find_cached_prefix(load=True)``): ``hit`` (the
    device pages of the prefix's first blocks) continued by the blocks that follow it on the
    device or in the tier, as far as free pages allow; the tier's are copied into free pages and
    cached there. Every page of the result is left cached and
    unreferenced (the caller's ``allocate`` takes them), as a device hit's are."""
    more: list[tuple[int, tuple, int | None]] = []  # (hash, key, device page or None: on the host)
    tier.pin(())  # ``find`` pins what it finds (a disk read may make room in the host tier)
    for i in range(len(hit), max_blocks):
        if i >= len(chain):
            chain.append(chain_hash(chain[-1][0] if chain else root, token_ids[i * block_size:(i + 1) * block_size]))
        block_hash, key = chain[i]
        page = pool.lookup(block_hash, key)
        if page is None and not tier.find(block_hash, key):
            break
        more.append((block_hash, key, page))
    on_device = [page for _, _, page in more if page is not None]
    pool.touch(hit + on_device)  # not evicted while pages are found for the others
    wanted = sum(1 for *_, page in more if page is None)
    # The pages' evictions store into the tier: not over the entries about to be read (pinned).
    pages: list[int] = []
    try:
        pages = pool.allocate(min(wanted, pool.num_free)) or []
        taken = iter(pages)
        result = list(hit)
        for block_hash, key, page in more:
            if page is None:
                    page = next(taken, None)
                    if page is None or not tier.load(block_hash, key, page):
                        break  # out of pages, or a disk file that did not check out: the hit ends
                    pool.register(page, block_hash, key)
                    holdings.changed(block_hash)
            result.append(page)
    finally:
        tier.pin(())
    # Tail first, as ``free`` does; pages a load did not fill go back unregistered.
    pool.release(reversed(hit + on_device + pages))
    return result


class PrefixLoader:
    def __init__(self, pool: BlockPool, tier: HostPrefixTier, holdings: PrefixHoldings, block_size: int):
        self.pool = pool
        self.tier = tier
        self.holdings = holdings
        self.block_size = block_size
        # Started by the engine thread's first load: not on the core its torch team was bound to.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-load",
                                                               initializer=unbind_current_thread)
        self._pending: list[PendingLoad] = []
        self._loading: set[int] = set()  # block hashes some pending load brings
        self.num_loads = 0  # loads started (a request may need several: the pages free at the time)

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def pages(self) -> list[int]:
        """The device pages pending loads hold (a reference each; ``KVCacheManager.check_invariants``)."""
        return [page for load in self._pending for page in load.head + [page for _, _, page in load.blocks]]

    def start(self, token_ids: Sequence[int], device_hit: Sequence[int], root: int | None = None,
              inline_below_s: float = INLINE_LOAD_S) -> bool:
        """Whether the request whose prompt is ``token_ids`` must wait for a load: its next block
        after ``device_hit`` (the pages of its prefix the pool holds) is being loaded, or is in the
        tier and a load of it (and the tier blocks right after it, as far as free pages go) starts
        now. Not when the load is expected to take less than ``inline_below_s``: the admission
        then makes it (``find_cached_prefix(load=True)``)."""
        max_blocks = (len(token_ids) - 1) // self.block_size
        head, device_hit = list(device_hit), len(device_hit)
        if device_hit >= max_blocks:
            return False
        parent = None
        blocks: list[tuple[int, tuple]] = []
        for i in range(max_blocks):
            parent, key = chain_hash(parent if i else root, token_ids[i * self.block_size:(i + 1) * self.block_size])
            if i < device_hit:
                continue
            if parent in self._loading:
                if not blocks:
                    return True  # the next block comes with someone else's load
                break
            if self.pool.lookup(parent, key) is not None or not self.tier.find(parent, key):
                break
            blocks.append((parent, key))
        if not blocks or self._expected_seconds(blocks) < inline_below_s:
            self.tier.pin(())
            return False  # nothing in the tier (the admission computes the rest), or a quick load
        self.pool.touch(head)  # not evicted to make room for the load, nor while it runs
        try:
            # Evictions these pages cause store into the tier, never over what was just found.
            pages = self.pool.allocate(min(len(blocks), self.pool.num_free)) or []
            if not pages:
                self.pool.release(reversed(head))
                return False  # no free page: the admission goes on as before
            load = PendingLoad([(h, key, page) for (h, key), page in zip(blocks, pages)], [], head)
            load.sources = self.tier.begin_load(load.blocks)
        finally:
            self.tier.pin(())
        self._loading.update(h for h, _, _ in load.blocks)
        self._pending.append(load)
        self.num_loads += 1
        self._executor.submit(self._copy, load)
        return True

    def _expected_seconds(self, blocks: list[tuple[int, tuple]]) -> float:
        """What copying ``blocks`` back should take, from what pages have cost from each tier so
        far (infinite while a tier has not brought enough back to say)."""
        total = 0.0
        for block_hash, _ in blocks:
            cost = self.tier.stats.page_seconds(disk=not self.tier.tier_of(block_hash) & HOST)
            if cost is None:
                return float("inf")
            total += cost
        return total

    def _copy(self, load: PendingLoad) -> None:
        try:
            load.future.set_result(self.tier.copy_in(load.blocks, load.sources))
        except BaseException as e:  # handed to the engine thread, which fails as it would have
            load.future.set_exception(e)

    def finish(self, wait: bool = False) -> None:
        """End the loads that are over (``wait``: block until one is, at most ``IDLE_WAIT_S``):
        the blocks written are cached in their pages, the rest of the pages go back free."""
        if not self._pending:
            return
        if wait:
            concurrent.futures.wait([load.future for load in self._pending], IDLE_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for load in [load for load in self._pending if load.future.done()]:
            self._pending.remove(load)
            self._loading.difference_update(h for h, _, _ in load.blocks)
            written = load.future.result()  # a copy that raised fails the step, as one inline would
            self.tier.end_load(load.blocks, load.sources, written, time.perf_counter() - load.started)
            for block_hash, key, page in load.blocks[:written]:
                self.pool.register(page, block_hash, key)
                self.holdings.changed(block_hash)
            self.pool.release(reversed(load.head + [page for _, _, page in load.blocks]))

    def close(self) -> None:
        """Wait for the copies under way (they write into the pool) and end them."""
        while self._pending:
            concurrent.futures.wait([load.future for load in self._pending])
            self.finish()
        self._executor.shutdown(wait=True)
