"""The pool of KV pages behind ``KVCacheManager`` (splitserve/engine/kv_cache_manager.py): each
page's ref count and, with prefix caching, its chain hash; the free pages in the order they are
reused (never-cached pages first, then cached ones least recently freed first); and the hash map a
prefix hit looks pages up in. Also the chain hashes themselves, which the gateway computes too
(splitserve/gateway/workers.py: where a prompt's prefix is likely cached).

Pure Python, like the manager: pages are ids; the model runner owns the tensors.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    # Chain hash of (parent hash, tokens) once the block is full and registered; None otherwise.
    block_hash: int | None = None
    # The exact key behind block_hash, compared on every hit so a hash collision is a miss.
    hash_key: tuple | None = None


# What the base model's first block is hashed with in place of a parent: ``hash(None)`` is the
# object's address on Python 3.11, different in every process, and the hashes must be the same in
# every worker and gateway (the cluster's prefix directory, splitserve/gateway/prefix_routing.py).
BASE_ROOT = 0x5EED


def chain_hash(parent_hash: int | None, tokens: Sequence[int]) -> tuple[int, tuple]:
    """Hash of one full block given its parent's hash (None: the first block of the base model).
    The same in every process: only ints are hashed, and ``hash`` of ints and tuples of them does
    not depend on the process (PYTHONHASHSEED salts strings and bytes only)."""
    key = (parent_hash, tuple(tokens))
    return hash((BASE_ROOT if parent_hash is None else parent_hash, key[1])), key


def chain_root(namespace: str) -> int:
    """The parent hash a chain of ``namespace`` (a LoRA adapter's name) starts from: the same in
    every process (``hash`` of a string is not), never None (the base model's root)."""
    return int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=8).digest(), "little", signed=True)


def group_hash(group: int, block_hash: int, key: tuple) -> tuple[int, tuple]:
    """The hash and key a block of group ``group`` is cached under: group 0's are the chain's
    own (what cache-aware routing computes, ``prefix_block_hashes``); another group's pages of the
    same tokens hold other layers, so they are cached under keys of their own."""
    if not group:
        return block_hash, key
    return hash((group, block_hash)), (group, key)


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None,
                        root: int | None = None) -> list[int]:
    """Chain hashes of the full blocks of a token sequence (used for cache-aware routing too);
    ``root``: where the chain starts (``chain_root`` of a LoRA adapter; None: the base model)."""
    hashes: list[int] = []
    parent = root
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
        # Told (block id, hash, key) when a cached block is about to be handed out again: its KV is
        # still intact then (the host tier copies it, splitserve/engine/kv_offload.py).
        self.on_evict: Callable[[int, int, tuple], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def cached_hashes(self) -> list[int]:
        return list(self._cached)

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
            if self.on_evict is not None:
                self.on_evict(block_id, block.block_hash, block.hash_key)
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
