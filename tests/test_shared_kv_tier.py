"""The host KV tier in shared memory (splitserve/engine/shared_kv_tier.py): what one worker stores
another loads, bit for bit; a slot being written, overwritten or corrupted is a miss, never wrong
KV; a set lets its least recently used page go; the last worker out removes the file, and one
left by killed workers is swept. The engine's part: a prompt one engine computed and evicted is a
prefix hit of another engine of the same host, with transformers' tokens."""
import subprocess
import sys

import pytest
import torch

from splitserve.engine import SamplingParams
from splitserve.engine.block_pool import chain_hash
from splitserve.engine.prefix_holdings import HOST
from splitserve.engine.shared_kv_tier import WAYS, SharedPrefixTier, sweep_dead_tiers

PAGES, BLOCK = 8, 4


def pool(seed: int) -> torch.Tensor:
    """A device pool as the runner lays it out: [layers, 2, pages, block, heads, dim]."""
    return torch.randn((3, 2, PAGES, BLOCK, 2, 8), generator=torch.Generator().manual_seed(seed))


def tier(pool_: torch.Tensor, directory, size_gb=16 * 3 * 2 * BLOCK * 2 * 8 * 4 / 2**30) -> SharedPrefixTier:
    return SharedPrefixTier(pool_, size_gb, BLOCK, "test", directory)


def block(i: int, parent=None):
    return chain_hash(parent, [i, i + 1, i + 2, i + 3])


def test_what_one_worker_stores_another_loads(tmp_path):
    a_pool, b_pool = pool(1), pool(2)
    a, b = tier(a_pool, tmp_path), tier(b_pool, tmp_path)
    assert a.num_slots == b.num_slots == 16
    h, key = block(10)
    assert not b.lookup(h, key)
    a.store(3, h, key)
    assert b.lookup(h, key) and b.tier_of(h) == HOST and not b.lookup(h, (None, (9, 9, 9, 9)))
    assert b.load(h, key, 5)
    assert torch.equal(b_pool[:, :, 5], a_pool[:, :, 3])
    # Through the loader's path too.
    h2, key2 = block(20, h)
    a.store(4, h2, key2)
    blocks = [(h, key, 6), (h2, key2, 7)]
    assert b.copy_in(blocks, b.begin_load(blocks)) == 2
    assert torch.equal(b_pool[:, :, 7], a_pool[:, :, 4])
    assert (a.stats.stored, b.stats.loaded) == (2, 1)
    a.close()
    b.close()


def test_a_slot_being_written_overwritten_or_corrupt_is_a_miss(tmp_path):
    a_pool, b_pool = pool(1), pool(2)
    a, b = tier(a_pool, tmp_path), tier(b_pool, tmp_path)
    h, key = block(10)
    a.store(3, h, key)
    slot = next(s for s in range(a.num_slots) if a._slots[s]["hash"] == h)
    before = b_pool[:, :, 5].clone()
    b._data[slot].view(torch.uint8).view(-1)[100] ^= 1  # one bit of the page, in the other worker's mapping
    assert b.lookup(h, key) and not b.load(h, key, 5)
    assert torch.equal(b_pool[:, :, 5], before)  # nothing written from it
    a._slots[slot]["state"] = 0  # gone: stored again, intact
    a.store(3, h, key)
    assert b.load(h, key, 5) and torch.equal(b_pool[:, :, 5], a_pool[:, :, 3])
    slot = next(s for s in range(a.num_slots) if a._slots[s]["hash"] == h and a._slots[s]["state"] == 2)
    a._slots[slot]["state"] = 1  # being written
    assert not b.lookup(h, key) and not b.load(h, key, 5)
    a._slots[slot]["state"] = 2
    # Overwritten between the reader's look at the header and its copy: what it copied is not
    # what the header it read describes.
    found = b._find(h, key)
    a._data[found[0]].copy_(a_pool[:, :, 4])
    b._find = lambda block_hash, key: found
    assert not b.load(h, key, 6) and not b.copy_in([(h, key, 6)], [0])
    a.close()
    b.close()


def test_a_full_set_lets_its_least_recently_used_page_go(tmp_path):
    a = tier(pool(1), tmp_path)
    changed = []
    a.on_change = changed.append
    same_set = []
    i = 0
    while len(same_set) < WAYS + 1:  # blocks whose hashes fall in one set
        h, key = block(1000 + i)
        i += 1
        if h % a.num_sets == 0:
            same_set.append((h, key))
    for h, key in same_set[:WAYS]:
        a.store(0, h, key)
    a.load(*same_set[0], 1)  # used: the second is the least recently used now
    a.store(0, *same_set[WAYS])
    assert [a.lookup(h, key) for h, key in same_set] == [True, False] + [True] * (WAYS - 1)
    assert a.stats.dropped == 1 and changed[-2:] == [same_set[1][0], same_set[WAYS][0]]
    a.close()


def test_the_last_worker_out_removes_the_file_and_a_killed_ones_is_swept(tmp_path):
    a, b = tier(pool(1), tmp_path), tier(pool(2), tmp_path)
    path = a.path
    a.close()
    assert path.exists()  # b still maps it
    assert sweep_dead_tiers(tmp_path) == [] and path.exists()
    b.close()
    assert not path.exists()
    # A worker that dies without closing: its lock goes with it, the file stays until a sweep.
    code = ("import sys, torch, os; sys.path.insert(0, '.');"
            "from tests.test_shared_kv_tier import pool, tier;"
            f"t = tier(pool(1), {str(tmp_path)!r}); os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert path.exists()
    assert sweep_dead_tiers(tmp_path) == [path] and not path.exists()


def test_a_tier_of_another_layout_is_refused(tmp_path):
    a = tier(pool(1), tmp_path)
    other = torch.zeros((3, 2, PAGES, BLOCK, 2, 16))
    with pytest.raises(ValueError, match="another layout"):
        SharedPrefixTier(other, 0.001, BLOCK, "test", tmp_path)
    a.close()


def test_a_prompt_one_engine_computed_is_a_hit_of_another(make_llm, tiny_model_dirs, llama_reference, private_shm):
    """Two engines of one host (one process here; the service test runs two workers): the first
    computes a prompt and three others push it out of its 32-page pool into the shared tier; the
    second, which never saw it, serves it from there (its 9 full blocks but the last token's)."""
    import random
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(40)] for _ in range(4)]
    kwargs = dict(num_gpu_blocks=32, block_size=BLOCK, kv_offloading_size=0.002, kv_offloading_shared=True)
    first, second = make_llm(tiny_model_dirs["llama"], **kwargs), make_llm(tiny_model_dirs["llama"], **kwargs)
    assert first.engine.kv.offload.path == second.engine.kv.offload.path
    outs = [first.generate([p], params)[0] for p in prompts]
    assert first.engine.kv.offload.stats.stored >= 9
    again = second.generate([prompts[0]], params)[0]
    assert again.num_cached_tokens == 36 and second.engine.kv.offload.stats.loaded >= 9
    assert [o.token_ids for o in outs] == [llama_reference.greedy(p, 6) for p in prompts]
    assert again.token_ids == outs[0].token_ids
    path = first.engine.kv.offload.path
    first.engine.close()
    assert path.exists()
    second.engine.close()
    assert not path.exists()
