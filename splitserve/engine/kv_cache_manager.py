"""Paged KV cache bookkeeping: block tables per request over the page pool
(splitserve/engine/block_pool.py), prefix caching, groups of layers, swap.

Pure Python on purpose (no torch): the manager decides *which* pages a request owns; the
model runner owns the tensors. Allocation either returns pages or ``None``; who to
preempt when it returns ``None`` is the scheduler's policy, not ours.

Prefix caching: every full block is identified by a chain hash over (parent hash, the
block's token ids). A request whose prompt starts with blocks already in the cache shares
them (ref count > 1). Blocks whose ref count drops to zero stay cached and reusable until
memory is needed; then the least recently freed one is evicted. A block with a non-zero
ref count is never evicted.

Groups (``kv_groups``): a model whose layers differ in attention kind has one block table per
group of layers per request, all drawn from the one pool. A windowed group gives a request's
pages back once no later token can read them (``slide``); the table keeps a placeholder there
(page 0, which the kernels never read: they skip pages outside the window). Prefix caching then
serves a prefix only where every group still has the pages its next tokens read: the full
groups all blocks of it, a windowed group the blocks of the window before its end (vLLM's
hybrid KV cache manager does the same).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from splitserve.engine.block_pool import BlockPool, PrefixCacheStats, chain_hash, group_hash
from splitserve.engine.kv_groups import window_pages
from splitserve.engine.kv_offload import HostPrefixTier, SwapSlots
from splitserve.engine.prefix_holdings import DEVICE, PrefixHoldings
from splitserve.engine.prefix_loads import PrefixLoader, load_in_place
from splitserve.engine.kv_sizes import pages_for_tokens

# Where a windowed group's table has given a page back: a valid page id that no kernel reads.
PLACEHOLDER = 0


@dataclass
class _Owner:
    """What the manager remembers per request."""
    # Block table per group (one group unless the model mixes attention kinds).
    tables: list[list[int]] = field(default_factory=list)
    # Per group: leading entries given back behind the window (placeholders now).
    released: list[int] = field(default_factory=list)
    # Parent hash for the next block to register and how many blocks are registered.
    num_hashed_blocks: int = 0
    last_hash: int | None = None
    # Swap preemption: the host blocks holding this request's pages while it is out.
    cpu_block_ids: list[int] | None = None

    @property
    def block_ids(self) -> list[int]:
        return self.tables[0]

    def held(self, group: int) -> list[int]:
        """The pages group ``group`` holds (its table past the placeholders)."""
        return self.tables[group][self.released[group]:]


class CachedPrefix(list):
    """``find_cached_prefix``'s answer: the first group's hit pages (a list, as a single-group
    caller wants them), and every group's table of the hit with its placeholders."""

    def __init__(self, tables: list[list[int]], released: list[int]):
        super().__init__(tables[0])
        self.tables = tables
        self.released = released


class KVCacheManager:
    """Block tables per request over a device pool (and a host pool for swap preemption)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0, windows: Sequence[int] = (0,), max_step_tokens: int | None = None,
                 offload: HostPrefixTier | None = None, overlap_loads: bool = False):
        """``windows``: each group's window (``kv_groups.KVGroups.windows``; 0: full attention).
        ``max_step_tokens``: the most tokens of one request a step computes (sizes a windowed
        group's need, ``blocks_needed``). ``offload``: the host tier evicted prefix pages go to;
        ``overlap_loads``: its hits are brought back by ``loader`` while steps go on."""
        if num_cpu_blocks and len(windows) > 1:
            raise ValueError("swap preemption needs one KV group (the hybrid KV layout recomputes)")
        if offload is not None and (len(windows) > 1 or not enable_prefix_caching):
            raise ValueError("the host KV tier needs prefix caching and one KV group")
        self.windows = tuple(windows)
        # Whether any group gives pages back behind a window (``slide`` has work to do).
        self.frees_pages = any(self.windows)
        self.max_step_tokens = max_step_tokens
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        # Swap preemption's host pages: the host tier's memory when there is one (num_cpu_blocks
        # then only says swapping is on), else a pool of their own.
        self.cpu_pool = (SwapSlots(offload) if offload is not None else BlockPool(num_cpu_blocks, enable_caching=False)) \
            if num_cpu_blocks else None
        self.offload = offload
        # Where each prefix block is (group 0's: what a prompt's chain hashes name), for the
        # cluster's prefix directory; marked on every change here and in the tiers below.
        self.holdings = PrefixHoldings(self._tier_of, self._held)
        self.pool.on_evict = self._evicted
        if offload is not None:
            offload.on_change = self.holdings.changed
        # Tier hits copied back on a thread of their own (the scheduler starts and ends the loads).
        self.loader = PrefixLoader(self.pool, offload, self.holdings, block_size) \
            if offload is not None and overlap_loads else None
        self._owners: dict[str, _Owner] = {}
        self.prefix_stats = PrefixCacheStats()

    def _evicted(self, block_id: int, block_hash: int, key: tuple) -> None:
        if self.offload is not None:
            self.offload.store(block_id, block_hash, key)
        self.holdings.changed(block_hash)

    def _held(self) -> list[int]:
        """Every block hash the pool and the tiers hold (a windowed model's other groups' too:
        they match no prompt)."""
        return [*self.pool.cached_hashes(), *(self.offload.hashes() if self.offload is not None else ())]

    def _tier_of(self, block_hash: int) -> int:
        """The tiers holding a block (``prefix_holdings`` bits)."""
        tiers = DEVICE if self.pool.holds(block_hash) else 0
        return tiers | (self.offload.tier_of(block_hash) if self.offload is not None else 0)

    # ---- queries -------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The first group's table (every layer's, unless the model mixes attention kinds)."""
        return self._owners[request_id].block_ids

    def block_tables(self, request_id: str) -> list[list[int]]:
        """Every group's table."""
        return self._owners[request_id].tables

    def owns(self, request_id: str) -> bool:
        return request_id in self._owners

    def blocks_needed(self, num_tokens: int) -> int:
        """Most pages a sequence of ``num_tokens`` tokens holds at once, over all groups."""
        step = self.max_step_tokens or num_tokens
        return sum(window_pages(w, self.block_size, num_tokens, step) for w in self.windows)

    def _first_needed(self, group: int, num_computed_tokens: int) -> int:
        """The first page group ``group`` still reads once ``num_computed_tokens`` tokens are in:
        a token at position p reads back to p - window + 1."""
        window = self.windows[group]
        return max(0, (num_computed_tokens - window + 1) // self.block_size) if window else 0

    # ---- allocation ----------------------------------------------------------------
    def find_cached_prefix(self, token_ids: Sequence[int], root: int | None = None,
                           load: bool = False) -> CachedPrefix:
        """Cached blocks matching the longest full-block prefix of ``token_ids`` that every group
        can serve (a windowed group: the blocks of the window before the prefix's end).

        The last token is never served from cache: its forward pass produces the logits of
        the next token, so at least one token is always computed. ``root``: where the hash chain
        starts (``Request.cache_root``: a LoRA adapter's blocks are its own). ``load`` (a request
        about to take its prefix): blocks of the host tier that continue the hit are brought back
        into free pages first (``prefix_loads.load_in_place``), and the hit includes them.
        """
        groups = len(self.windows)
        if not self.enable_prefix_caching:
            return CachedPrefix([[] for _ in range(groups)], [0] * groups)
        max_blocks = (len(token_ids) - 1) // self.block_size
        chain: list[tuple[int, tuple]] = []  # hashed as far as a lookup asked (a miss ends the search early)
        found: list[dict[int, int]] = [{} for _ in range(groups)]

        def lookup(group: int, i: int) -> int | None:
            while len(chain) <= i:
                j = len(chain)
                chain.append(chain_hash(chain[-1][0] if chain else root,
                                        token_ids[j * self.block_size:(j + 1) * self.block_size]))
            if i not in found[group]:
                block_id = self.pool.lookup(*group_hash(group, *chain[i]))
                if block_id is None:
                    return None
                found[group][i] = block_id
            return found[group][i]

        # The full groups need every block of the prefix: the longest run all of them have.
        hit = max_blocks
        for group, window in enumerate(self.windows):
            if not window:
                hit = next((i for i in range(hit) if lookup(group, i) is None), hit)
        # A windowed group needs the blocks its window reads back from the prefix's end. A block
        # it lacks rules out every prefix whose window covers it: try again ending before it.
        while hit > 0:
            missing = None
            for group, window in enumerate(self.windows):
                if window:
                    first = self._first_needed(group, hit * self.block_size)
                    missing = next((i for i in range(hit - 1, first - 1, -1) if lookup(group, i) is None), None)
                    if missing is not None:
                        break
            if missing is None:
                break
            hit = missing
        if load and self.offload is not None and hit < max_blocks:
            return CachedPrefix([load_in_place(self.pool, self.offload, self.holdings, self.block_size, token_ids,
                                               chain, [found[0][i] for i in range(hit)], max_blocks, root)], [0])
        tables, released = [], []
        for group in range(groups):
            first = self._first_needed(group, hit * self.block_size) if hit else 0
            tables.append([PLACEHOLDER] * first + [found[group][i] for i in range(first, hit)])
            released.append(first)
        return CachedPrefix(tables, released)

    def next_block_hash(self, token_ids: Sequence[int], cached_blocks: Sequence[int],
                        root: int | None = None) -> int | None:
        """Chain hash of the block ``find_cached_prefix`` would serve right after ``cached_blocks``
        (what it returned for ``token_ids``); None when no further block could be served."""
        k = len(cached_blocks)
        if k >= (len(token_ids) - 1) // self.block_size:
            return None
        parent = self.pool.blocks[cached_blocks[-1]].block_hash if cached_blocks else root  # group 0: plain hashes
        return chain_hash(parent, token_ids[k * self.block_size:(k + 1) * self.block_size])[0]

    def unregistered_block_hashes(self, request_id: str, token_ids: Sequence[int],
                                  root: int | None = None) -> list[int]:
        """Chain hashes of ``request_id``'s full blocks of ``token_ids`` not registered yet: for a
        request still prefilling, the blocks its coming forwards compute (``cache_full_blocks``
        registers them after each one)."""
        owner = self._owners[request_id]
        hashes, parent = [], owner.last_hash if owner.num_hashed_blocks else root
        for i in range(owner.num_hashed_blocks, len(token_ids) // self.block_size):
            parent, _ = chain_hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    def can_allocate(self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        owner = self._owners.get(request_id)
        need = self.blocks_needed_now(num_tokens, owner, cached_blocks)
        return need <= self.pool.num_free

    def blocks_needed_now(self, num_tokens: int, owner: _Owner | None, cached_blocks: Sequence[int] = ()) -> int:
        """Free pages growing to ``num_tokens`` tokens takes (the pool's free count includes cached
        blocks nobody references: a hit on one uses it up)."""
        need = 0
        pages = pages_for_tokens(num_tokens, self.block_size)
        for group in range(len(self.windows)):
            if owner is not None:
                need += max(0, pages - len(owner.tables[group]))
                continue
            table, released = self._hit_of(cached_blocks, group)
            need += max(0, pages - len(table)) + sum(1 for b in table[released:] if self.pool.blocks[b].ref_count == 0)
        return need

    @staticmethod
    def _hit_of(cached_blocks: Sequence[int], group: int) -> tuple[list[int], int]:
        """(table, placeholders) of a prefix hit for ``group``: a ``CachedPrefix`` carries every
        group's; a plain list is the first group's only (what a single-group caller may pass)."""
        if isinstance(cached_blocks, CachedPrefix):
            return cached_blocks.tables[group], cached_blocks.released[group]
        if group and cached_blocks:
            raise ValueError("a prefix hit of a multi-group manager must come from find_cached_prefix")
        return (list(cached_blocks) if not group else []), 0

    def allocate(self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> list[int] | None:
        """Grow ``request_id``'s block tables to hold ``num_tokens`` tokens.

        ``cached_blocks`` (first allocation only) are prefix hits from ``find_cached_prefix``.
        Returns the new block ids, or None (and changes nothing) when the pool is short.
        """
        if not self.can_allocate(request_id, num_tokens, cached_blocks):
            return None
        owner = self._owners.get(request_id)
        if owner is None:
            owner = self._owners[request_id] = _Owner()
            for group in range(len(self.windows)):
                table, released = self._hit_of(cached_blocks, group)
                self.pool.touch(table[released:])
                owner.tables.append(list(table))
                owner.released.append(released)
            if cached_blocks:
                owner.num_hashed_blocks = len(cached_blocks)
                owner.last_hash = self.pool.blocks[cached_blocks[-1]].block_hash
        pages = pages_for_tokens(num_tokens, self.block_size)
        out: list[int] = []
        for table in owner.tables:
            need = pages - len(table)
            new = self.pool.allocate(need) if need > 0 else []
            if new is None:  # cannot happen after can_allocate; kept so state stays consistent
                raise RuntimeError("block pool changed under allocate")
            table.extend(new)
            out.extend(new)
        return out

    def slide(self, request_id: str, num_computed_tokens: int) -> int:
        """Give back the pages of ``request_id``'s windowed groups that no token from position
        ``num_computed_tokens`` on reads; returns how many. Called before each step of a request:
        its new tokens are at those positions."""
        owner = self._owners[request_id]
        freed = 0
        for group, window in enumerate(self.windows):
            if not window:
                continue
            first = min(self._first_needed(group, num_computed_tokens), len(owner.tables[group]))
            table = owner.tables[group]
            gone = table[owner.released[group]:first]
            if gone:
                self.pool.release(gone)
                table[owner.released[group]:first] = [PLACEHOLDER] * len(gone)
                owner.released[group] = first
                freed += len(gone)
        return freed

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                          root: int | None = None) -> None:
        """Register the blocks whose every token now has its KV written."""
        if not self.enable_prefix_caching:
            return
        owner = self._owners[request_id]
        num_full = min(num_computed_tokens, len(token_ids)) // self.block_size
        for i in range(owner.num_hashed_blocks, num_full):
            parent = owner.last_hash if i else root
            block_hash, key = chain_hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            for group, table in enumerate(owner.tables):
                if i >= owner.released[group]:
                    self.pool.register(table[i], *group_hash(group, block_hash, key))
            self.holdings.changed(block_hash)
            owner.last_hash = block_hash
            owner.num_hashed_blocks = i + 1

    def rename(self, request_id: str, new_id: str) -> None:
        """Hold a request's pages under another id (the request's own id is free again)."""
        if new_id in self._owners:
            raise ValueError(f"{new_id!r} already holds pages")
        self._owners[new_id] = self._owners.pop(request_id)

    def free(self, request_id: str) -> None:
        """Return every page of a request (device and host). Safe to call twice."""
        owner = self._owners.pop(request_id, None)
        if owner is None:
            return
        # Tail first, so the LRU evicts a prompt's tail before its shared head.
        for group in range(len(owner.tables)):
            self.pool.release(reversed(owner.held(group)))
        if owner.cpu_block_ids and self.cpu_pool is not None:
            self.cpu_pool.release(owner.cpu_block_ids)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the pages past the first ``num_tokens`` tokens: speculative decoding reserved
        them for proposals that were rejected. They hold no registered (full, computed) block."""
        owner = self._owners[request_id]
        keep = pages_for_tokens(num_tokens, self.block_size)
        for group, table in enumerate(owner.tables):
            if len(table) > keep:
                extra = table[max(keep, owner.released[group]):]
                del table[keep:]
                owner.released[group] = min(owner.released[group], keep)
                self.pool.release(reversed(extra))

    # ---- swap preemption -----------------------------------------------------------
    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move a request's pages to host blocks. Returns (device, host) pairs to copy, or None
        (with the host tier, the copies are made here and there are none to return)."""
        owner = self._owners[request_id]
        if self.cpu_pool is None:
            return None
        cpu_blocks = self.cpu_pool.allocate(len(owner.block_ids))
        if cpu_blocks is None:
            return None
        pairs = list(zip(owner.block_ids, cpu_blocks))
        if isinstance(self.cpu_pool, SwapSlots):  # copied now, before the pages can be reused
            self.cpu_pool.copy_out(pairs)
            pairs = []
        self.pool.release(reversed(owner.block_ids))
        owner.tables, owner.released, owner.cpu_block_ids = [[]], [0], cpu_blocks
        owner.num_hashed_blocks, owner.last_hash = 0, None
        return pairs

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        """Bring a swapped request back. Returns (host, device) pairs to copy, or None."""
        owner = self._owners[request_id]
        assert owner.cpu_block_ids is not None, "swap_in of a request that is not swapped out"
        device_blocks = self.pool.allocate(len(owner.cpu_block_ids))
        if device_blocks is None:
            return None
        pairs = list(zip(owner.cpu_block_ids, device_blocks))
        if isinstance(self.cpu_pool, SwapSlots):  # copied now, before the slots can be reused
            self.cpu_pool.copy_in(pairs)
            pairs = []
        self.cpu_pool.release(owner.cpu_block_ids)
        owner.tables, owner.released, owner.cpu_block_ids = [device_blocks], [0], None
        return pairs

    def is_swapped(self, request_id: str) -> bool:
        owner = self._owners.get(request_id)
        return owner is not None and owner.cpu_block_ids is not None

    def num_swap_in_blocks(self, request_id: str) -> int:
        return len(self._owners[request_id].cpu_block_ids or ())

    # ---- checks --------------------------------------------------------------------
    def check_invariants(self) -> None:
        self.pool.check_invariants()
        if self.offload is not None:
            self.offload.check_invariants()
        if self.cpu_pool is not None:
            self.cpu_pool.check_invariants()
        expected = [0] * self.pool.num_blocks
        for page in self.loader.pages() if self.loader is not None else ():
            expected[page] += 1
        for owner in self._owners.values():
            for group in range(len(owner.tables)):
                for block_id in owner.held(group):
                    expected[block_id] += 1
        actual = [block.ref_count for block in self.pool.blocks]
        if expected != actual:
            raise AssertionError("ref counts do not match the block tables")

    def assert_idle(self) -> None:
        """No request holds a page: every block is free (plain or cached)."""
        if self.loader is not None and self.loader.busy:
            raise AssertionError("prefix loads still under way")
        self.check_invariants()
        if self._owners:
            raise AssertionError(f"requests still own pages: {sorted(self._owners)}")
        if self.pool.num_free != self.pool.num_blocks:
            raise AssertionError(f"{self.pool.num_blocks - self.pool.num_free} blocks not returned")
        if self.cpu_pool is not None and self.cpu_pool.num_free != self.cpu_pool.num_blocks:
            raise AssertionError("host swap blocks not returned")
