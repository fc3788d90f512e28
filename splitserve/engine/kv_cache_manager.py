"""Paged KV cache bookkeeping: blocks, block tables, ref counts and prefix caching.

Pure Python on purpose (no torch): the manager decides *which* pages a request owns; the
model runner owns the tensors. Allocation either returns pages or ``None``; who to
preempt when it returns ``None`` is the scheduler's policy, not ours.

Prefix caching: every full block is identified by a chain hash over (parent hash, the
block's token ids). A request whose prompt starts with blocks already in the cache shares
them (ref count > 1). Blocks whose ref count drops to zero stay cached and reusable until
memory is needed; then the least recently freed one is evicted. A block with a non-zero
ref count is never evicted.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from splitserve.engine.kv_sizes import pages_for_tokens


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    # Chain hash of (parent hash, tokens) once the block is full and registered; None otherwise.
    block_hash: int | None = None
    # The exact key behind block_hash, compared on every hit so a hash collision is a miss.
    hash_key: tuple | None = None


def chain_hash(parent_hash: int | None, tokens: Sequence[int]) -> tuple[int, tuple]:
    """Hash of one full block given its parent's hash. Stable across processes (ints only)."""
    key = (parent_hash, tuple(tokens))
    return hash(key), key


def chain_root(namespace: str) -> int:
    """The parent hash a chain of ``namespace`` (a LoRA adapter's name) starts from: the same in
    every process (``hash`` of a string is not), never None (the base model's root)."""
    return int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=8).digest(), "little", signed=True)


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[int]:
    """Chain hashes of the full blocks of a token sequence (used for cache-aware routing too)."""
    hashes: list[int] = []
    parent = None
    n_full = len(token_ids) // block_size
    if max_blocks is not None:
        n_full = min(n_full, max_blocks)
    for i in range(n_full):
        parent, _ = chain_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


@dataclass
class PrefixCacheStats:
    """Counted by the scheduler once per admitted request (a lookup that the pool could not
    serve yet, and is tried again, counts once: when it is admitted)."""

    queries: int = 0  # prompt tokens of admitted requests
    hits: int = 0  # of those, tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Owns every block of one pool: free lists, the hash → block map and ref counts."""

    def __init__(self, num_blocks: int, enable_caching: bool):
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        # Free blocks holding nothing reusable: handed out first.
        self._free_plain: deque[int] = deque(range(num_blocks))
        # Free blocks still holding a cached prefix, least recently freed first (evicted first).
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[int, int] = {}  # block_hash -> block_id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: int, key: tuple) -> int | None:
        block_id = self._cached.get(block_hash)
        if block_id is None or self.blocks[block_id].hash_key != key:
            return None
        return block_id

    def allocate(self, n: int) -> list[int] | None:
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._free_plain:
                block_id = self._free_plain.popleft()
            else:
                block_id, _ = self._free_cached.popitem(last=False)
                self._evict(block_id)
            self.blocks[block_id].ref_count = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones out of the free list."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free_cached[block_id]
            block.ref_count += 1

    def release(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} released more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._free_cached[block_id] = None
                else:
                    self._free_plain.append(block_id)

    def register(self, block_id: int, block_hash: int, key: tuple) -> bool:
        """Make a full block findable by its hash. False when an equal block is already cached."""
        if not self.enable_caching:
            return False
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._cached:
            return False
        block.block_hash, block.hash_key = block_hash, key
        self._cached[block_hash] = block_id
        return True

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = block.hash_key = None

    def check_invariants(self) -> None:
        free = set(self._free_plain) | set(self._free_cached)
        if len(free) != self.num_free:
            raise AssertionError("a block sits twice in the free lists")
        for block in self.blocks:
            if (block.ref_count == 0) != (block.block_id in free):
                raise AssertionError(f"block {block.block_id}: ref_count {block.ref_count} vs free lists")
            if block.block_id in self._free_cached and block.block_hash is None:
                raise AssertionError(f"block {block.block_id} is on the cached free list without a hash")
        for block_hash, block_id in self._cached.items():
            if self.blocks[block_id].block_hash != block_hash:
                raise AssertionError(f"hash map points at block {block_id} holding another hash")


@dataclass
class _Owner:
    """What the manager remembers per request."""
    block_ids: list[int] = field(default_factory=list)
    # Parent hash for the next block to register and how many blocks are registered.
    num_hashed_blocks: int = 0
    last_hash: int | None = None
    # Swap preemption: the host blocks holding this request's pages while it is out.
    cpu_block_ids: list[int] | None = None


class KVCacheManager:
    """Block tables per request over a device pool (and a host pool for swap preemption)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_caching=False) if num_cpu_blocks else None
        self._owners: dict[str, _Owner] = {}
        self.prefix_stats = PrefixCacheStats()

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
        return self._owners[request_id].block_ids

    def owns(self, request_id: str) -> bool:
        return request_id in self._owners

    def blocks_needed(self, num_tokens: int) -> int:
        return pages_for_tokens(num_tokens, self.block_size)

    # ---- allocation ----------------------------------------------------------------
    def find_cached_prefix(self, token_ids: Sequence[int], root: int | None = None) -> list[int]:
        """Cached blocks matching the longest full-block prefix of ``token_ids``.

        The last token is never served from cache: its forward pass produces the logits of
        the next token, so at least one token is always computed. ``root``: where the hash chain
        starts (``Request.cache_root``: a LoRA adapter's blocks are its own).
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[int] = []
        parent = root
        for i in range(max_blocks):
            parent, key = chain_hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self.pool.lookup(parent, key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def next_block_hash(self, token_ids: Sequence[int], cached_blocks: Sequence[int],
                        root: int | None = None) -> int | None:
        """Chain hash of the block ``find_cached_prefix`` would serve right after ``cached_blocks``
        (what it returned for ``token_ids``); None when no further block could be served."""
        k = len(cached_blocks)
        if k >= (len(token_ids) - 1) // self.block_size:
            return None
        parent = self.pool.blocks[cached_blocks[-1]].block_hash if cached_blocks else root
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
        have = len(owner.block_ids) if owner else len(cached_blocks)
        # Cached blocks that nobody references sit in the free count; taking them uses it up.
        idle_cached = 0 if owner else sum(1 for b in cached_blocks if self.pool.blocks[b].ref_count == 0)
        return self.blocks_needed(num_tokens) - have + idle_cached <= self.pool.num_free

    def allocate(self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> list[int] | None:
        """Grow ``request_id``'s block table to hold ``num_tokens`` tokens.

        ``cached_blocks`` (first allocation only) are prefix hits from ``find_cached_prefix``.
        Returns the new block ids, or None (and changes nothing) when the pool is short.
        """
        if not self.can_allocate(request_id, num_tokens, cached_blocks):
            return None
        owner = self._owners.get(request_id)
        if owner is None:
            owner = self._owners[request_id] = _Owner()
            if cached_blocks:
                self.pool.touch(cached_blocks)
                owner.block_ids.extend(cached_blocks)
                owner.num_hashed_blocks = len(cached_blocks)
                owner.last_hash = self.pool.blocks[cached_blocks[-1]].block_hash
        need = self.blocks_needed(num_tokens) - len(owner.block_ids)
        new = self.pool.allocate(need) if need > 0 else []
        if new is None:  # cannot happen after can_allocate; kept so state stays consistent
            raise RuntimeError("block pool changed under allocate")
        owner.block_ids.extend(new)
        return new

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
            self.pool.register(owner.block_ids[i], block_hash, key)
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
        self.pool.release(reversed(owner.block_ids))
        if owner.cpu_block_ids and self.cpu_pool is not None:
            self.cpu_pool.release(owner.cpu_block_ids)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the pages past the first ``num_tokens`` tokens: speculative decoding reserved
        them for proposals that were rejected. They hold no registered (full, computed) block."""
        owner = self._owners[request_id]
        keep = self.blocks_needed(num_tokens)
        if len(owner.block_ids) > keep:
            extra = owner.block_ids[keep:]
            del owner.block_ids[keep:]
            self.pool.release(reversed(extra))

    # ---- swap preemption -----------------------------------------------------------
    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move a request's pages to host blocks. Returns (device, host) pairs to copy, or None."""
        owner = self._owners[request_id]
        if self.cpu_pool is None:
            return None
        cpu_blocks = self.cpu_pool.allocate(len(owner.block_ids))
        if cpu_blocks is None:
            return None
        pairs = list(zip(owner.block_ids, cpu_blocks))
        self.pool.release(reversed(owner.block_ids))
        owner.block_ids, owner.cpu_block_ids = [], cpu_blocks
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
        self.cpu_pool.release(owner.cpu_block_ids)
        owner.block_ids, owner.cpu_block_ids = device_blocks, None
        return pairs

    def is_swapped(self, request_id: str) -> bool:
        owner = self._owners.get(request_id)
        return owner is not None and owner.cpu_block_ids is not None

    def num_swap_in_blocks(self, request_id: str) -> int:
        return len(self._owners[request_id].cpu_block_ids or ())

    # ---- checks --------------------------------------------------------------------
    def check_invariants(self) -> None:
        self.pool.check_invariants()
        if self.cpu_pool is not None:
            self.cpu_pool.check_invariants()
        expected = [0] * self.pool.num_blocks
        for owner in self._owners.values():
            for block_id in owner.block_ids:
                expected[block_id] += 1
        actual = [block.ref_count for block in self.pool.blocks]
        if expected != actual:
            raise AssertionError("ref counts do not match the block tables")

    def assert_idle(self) -> None:
        """No request holds a page: every block is free (plain or cached)."""
        self.check_invariants()
        if self._owners:
            raise AssertionError(f"requests still own pages: {sorted(self._owners)}")
        if self.pool.num_free != self.pool.num_blocks:
            raise AssertionError(f"{self.pool.num_blocks - self.pool.num_free} blocks not returned")
        if self.cpu_pool is not None and self.cpu_pool.num_free != self.cpu_pool.num_blocks:
            raise AssertionError("host swap blocks not returned")
