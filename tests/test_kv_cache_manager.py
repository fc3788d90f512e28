"""The KV cache manager is pure Python: these tests must run without torch."""
import random
import sys

import pytest

from splitserve.engine.block_pool import prefix_block_hashes
from splitserve.engine.kv_cache_manager import KVCacheManager


def test_imports_without_torch():
    assert "splitserve.engine.kv_cache_manager" in sys.modules
    import subprocess
    code = ("import sys; sys.modules['torch'] = None; "
            "import splitserve.engine.kv_cache_manager as m; m.KVCacheManager(4, 16)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocate_on_demand_and_free():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    assert kv.allocate("a", 5) == [0, 1]
    assert kv.allocate("a", 8) == []  # still fits in two blocks
    assert kv.allocate("a", 9) == [2]
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5
    kv.free("a")
    kv.free("a")  # twice is harmless
    kv.assert_idle()


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    assert kv.allocate("a", 8) is not None
    assert kv.allocate("b", 8) is None  # needs 2, 1 free
    assert not kv.owns("b")
    assert kv.num_free_blocks == 1
    kv.free("a")
    kv.assert_idle()


def test_prefix_hit_shares_blocks_and_keeps_last_token_uncached():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(12))
    assert kv.find_cached_prefix(prompt) == []
    kv.allocate("a", len(prompt))
    kv.cache_full_blocks("a", prompt, num_computed_tokens=12)
    assert kv.num_cached_blocks == 3
    # Same 12 tokens: only 2 blocks may be reused, the last token is always recomputed.
    hits = kv.find_cached_prefix(prompt)
    assert hits == kv.block_table("a")[:2]
    # A longer prompt with the same start reuses all 3.
    longer = prompt + [99, 98]
    hits = kv.find_cached_prefix(longer)
    assert hits == kv.block_table("a")
    kv.allocate("b", len(longer), hits)
    assert kv.block_table("b")[:3] == kv.block_table("a")
    assert [kv.pool.blocks[b].ref_count for b in kv.block_table("a")] == [2, 2, 2]
    kv.check_invariants()
    kv.free("a")
    kv.free("b")
    kv.assert_idle()
    assert kv.num_cached_blocks == 3  # still cached after free


def test_chain_hash_distinguishes_position():
    # The same block of tokens after a different prefix is a different block.
    a = prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = prefix_block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert a[1] != b[1]
    assert prefix_block_hashes([1, 2, 3, 4, 5], 4) == a[:1]


def test_lru_evicts_least_recently_freed_cached_block_and_prefers_plain_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    for rid, toks in (("a", [1, 2]), ("b", [3, 4])):
        kv.allocate(rid, 2)
        kv.cache_full_blocks(rid, toks, 2)
    block_a, block_b = kv.block_table("a")[0], kv.block_table("b")[0]
    kv.free("a")
    kv.free("b")
    # Two plain free blocks go first; the cached ones survive.
    kv.allocate("c", 4)
    assert kv.num_cached_blocks == 2
    # Next allocation must evict: a was freed first, so a goes.
    kv.allocate("d", 2)
    assert kv.block_table("d") == [block_a]
    assert kv.find_cached_prefix([3, 4, 0]) == [block_b]
    assert kv.find_cached_prefix([1, 2, 0]) == []
    kv.free("c")
    kv.free("d")
    kv.assert_idle()


def test_running_blocks_are_never_evicted():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    kv.allocate("a", 2)
    kv.cache_full_blocks("a", [1, 2], 2)
    assert kv.allocate("b", 4) is None  # only one free block; a's block is referenced
    assert kv.find_cached_prefix([1, 2, 3]) == kv.block_table("a")
    kv.free("a")
    kv.assert_idle()


def test_touching_an_idle_cached_block_counts_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    kv.allocate("a", 2)
    kv.cache_full_blocks("a", [1, 2], 2)
    kv.free("a")
    hits = kv.find_cached_prefix([1, 2, 3, 4, 5, 6])
    assert len(hits) == 1
    # 6 tokens = 3 blocks: 1 cached (idle, counted free) + 2 new = all 3 free blocks.
    assert kv.allocate("b", 6, hits) is not None
    assert kv.num_free_blocks == 0
    kv.free("b")
    kv.assert_idle()


def test_swap_out_and_in_round_trip():
    kv = KVCacheManager(num_blocks=4, block_size=2, num_cpu_blocks=4)
    kv.allocate("a", 5)
    table = list(kv.block_table("a"))
    pairs = kv.swap_out("a")
    assert [d for d, _ in pairs] == table
    assert kv.is_swapped("a") and kv.num_free_blocks == 4
    back = kv.swap_in("a")
    assert [c for c, _ in back] == [c for _, c in pairs]
    assert not kv.is_swapped("a")
    assert kv.block_table("a") == [d for _, d in back]
    kv.free("a")
    kv.assert_idle()


def test_swap_out_fails_cleanly_without_host_room():
    kv = KVCacheManager(num_blocks=4, block_size=2, num_cpu_blocks=1)
    kv.allocate("a", 4)
    assert kv.swap_out("a") is None
    assert kv.block_table("a") and not kv.is_swapped("a")
    kv.free("a")
    kv.assert_idle()


def test_invariant_check_catches_a_leak():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate("a", 2)
    with pytest.raises(AssertionError):
        kv.assert_idle()
    kv.free("a")
    kv.assert_idle()


def test_random_workload_keeps_invariants():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=32, block_size=4, num_cpu_blocks=16)
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 20))] for _ in range(8)]
    live: dict[str, list[int]] = {}
    for step in range(2000):
        op = rng.random()
        if op < 0.4 and len(live) < 8:
            rid = f"r{step}"
            toks = list(rng.choice(prompts))
            hits = kv.find_cached_prefix(toks)
            if kv.allocate(rid, len(toks), hits) is not None:
                kv.cache_full_blocks(rid, toks, len(toks))
                live[rid] = toks
        elif op < 0.7 and live:
            rid = rng.choice(list(live))
            if not kv.is_swapped(rid):
                live[rid].append(rng.randrange(3))
                if kv.allocate(rid, len(live[rid])) is not None:
                    kv.cache_full_blocks(rid, live[rid], len(live[rid]))
                else:
                    live[rid].pop()
        elif op < 0.8 and live:
            rid = rng.choice(list(live))
            if kv.is_swapped(rid):
                kv.swap_in(rid)
            else:
                kv.swap_out(rid)
        elif live:
            rid = rng.choice(list(live))
            kv.free(rid)
            del live[rid]
        kv.check_invariants()
    for rid in live:
        kv.free(rid)
    kv.assert_idle()
