"""The host KV tier below the pool (splitserve/engine/kv_offload.py): prefix pages the pool evicts
are kept there and a later prefix hit brings them back.

The KV manager's part without a model: pages hold, in a fake memory, the chain hash of the block
computed into them, so every prefix hit can be checked to read its own blocks' KV, through
hundreds of random admissions in a pool and a tier both too small for what is sent. The engine's:
a prompt evicted from the pool comes back from the tier, and its greedy output is transformers'.
"""
import random
import threading

import pytest

from splitserve.engine import SamplingParams
from splitserve.engine.block_pool import chain_hash
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.kv_offload import HostPrefixTier
from splitserve.engine.prefix_holdings import DEVICE, DISK, HOST, HoldingsDelta

BLOCK = 4


class FakeMemory:
    """A PageCopier over pages that hold the chain hash of the block computed into them."""

    def __init__(self, pages: int, slots: int):
        self.device: list[int | None] = [None] * pages
        self.host: list[int | None] = [None] * slots

    def store(self, page: int, slot: int) -> None:
        self.host[slot] = self.device[page]

    def load(self, slot: int, page: int) -> None:
        self.device[page] = self.host[slot]

    def read_slot(self, slot: int) -> bytes:
        return str(self.host[slot]).encode()

    def write_page(self, page: int, data: bytes) -> None:
        self.device[page] = int(data)


def held_now(kv: KVCacheManager) -> dict[int, int]:
    """Every block the pool and the tiers hold, with the tiers holding it, read from their own maps."""
    held: dict[int, int] = {}
    for tier, hashes in ((DISK, kv.offload.disk._files if kv.offload.disk is not None else ()),
                         (HOST, kv.offload._entries), (DEVICE, kv.pool._cached)):
        for block_hash in hashes:
            held[block_hash] = held.get(block_hash, 0) | tier
    return held


def block_hashes(tokens: list[int]) -> list[int]:
    hashes, parent = [], None
    for i in range(len(tokens) // BLOCK):
        parent, _ = chain_hash(parent, tokens[i * BLOCK:(i + 1) * BLOCK])
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("disk", [False, True])
def test_every_hit_reads_its_own_blocks_kv_through_pool_and_tiers(disk, overlap, tmp_path):
    """With ``disk``: a host tier of 6 pages over a disk tier of about 12, so pages go down to
    disk and come back up from it, and the disk tier drops files too. With ``overlap``, hits in
    the tiers come back through the loader thread (``PrefixLoader``), as the scheduler has them:
    a request whose prefix is being loaded waits (here: it is dropped, and a later one may find
    the blocks), and a load is left under way for a while, at random, while others are admitted."""
    rng = random.Random(7)
    pages, slots = 24, (6 if disk else 20)
    memory = FakeMemory(pages, slots)
    tier = HostPrefixTier(slots, memory, tmp_path / "kv" if disk else None, 12 * 80 if disk else 0)
    kv = KVCacheManager(pages, BLOCK, offload=tier, overlap_loads=overlap)
    documents = [[rng.randrange(1, 500) for _ in range(rng.choice((8, 16, 24)))] for _ in range(8)]
    running: list[str] = []
    served_from_tier = 0
    directory: dict[int, int] = {}  # what the cluster's prefix directory learns from the deltas

    def publish(n):
        delta = kv.holdings.delta()
        assert not set(delta.held) & set(delta.gone)
        directory.update(delta.held)
        for block_hash in delta.gone:
            del directory[block_hash]
        assert directory == held_now(kv) == kv.holdings.published, n
    for n in range(600):
        publish(n)
        if running and (len(running) > 3 or rng.random() < 0.4):
            kv.free(running.pop(rng.randrange(len(running))))
        tokens = rng.choice(documents) + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 9))]
        loaded_before = tier.stats.loaded + tier.stats.disk_loaded
        if overlap:
            kv.loader.finish()  # what ended meanwhile
            if kv.loader.start(tokens, kv.find_cached_prefix(tokens), inline_below_s=0):
                if rng.random() < 0.5:
                    kv.check_invariants()  # the load's pages held by the load itself
                    continue
                while kv.loader.busy:
                    kv.loader.finish(wait=True)
                served_from_tier += tier.stats.loaded + tier.stats.disk_loaded - loaded_before
                loaded_before = tier.stats.loaded + tier.stats.disk_loaded
        cached = kv.find_cached_prefix(tokens, load=not overlap)
        want = block_hashes(tokens)
        assert [memory.device[page] for page in cached] == want[:len(cached)], n  # each hit page: its block
        served_from_tier += tier.stats.loaded + tier.stats.disk_loaded - loaded_before
        rid = f"r{n}"
        if kv.allocate(rid, len(tokens), cached) is None:
            kv.check_invariants()
            continue
        table = kv.block_table(rid)
        for i in range(len(cached), len(tokens) // BLOCK):  # "compute" the rest
            memory.device[table[i]] = want[i]
        kv.cache_full_blocks(rid, tokens, len(tokens))
        running.append(rid)
        kv.check_invariants()
    if overlap:
        kv.loader.close()
        assert kv.loader.num_loads > 30
    publish("end")
    for rid in running:
        kv.free(rid)
    kv.assert_idle()
    assert kv.holdings.delta() == HoldingsDelta({}, [])  # freeing moves no block: they stay cached where they were
    # The paths above all ran: pages stored, brought back for hits, and the tier full and dropping.
    assert tier.stats.stored > 50 and served_from_tier > 50 and tier.stats.dropped > 0
    if disk:
        assert tier.stats.disk_stored > 20 and tier.stats.disk_loaded > 10 and tier.stats.disk_dropped > 0
        tier.close()
        assert not (tmp_path / "kv").exists()


def test_a_disk_page_that_does_not_check_out_is_a_miss(tmp_path):
    """One host slot over a disk tier: a page spilled to disk and then corrupted (one byte) or cut
    short does not load, and its file is gone; an intact one comes back with its content."""
    memory = FakeMemory(4, 1)
    tier = HostPrefixTier(1, memory, tmp_path, 1 << 20)
    for page, h in enumerate((21, 22, 23)):
        memory.device[page] = h
        tier.store(page, h, (None, (h,)))  # 21, then 22 push the one before down to disk
    files = {p.name: p for p in tmp_path.iterdir()}
    assert len(files) == 2 and tier.stats.disk_stored == 2
    first, second = sorted(files.values(), key=lambda p: p.stat().st_mtime_ns)
    data = bytearray(first.read_bytes())
    data[-1] ^= 1
    first.write_bytes(bytes(data))
    second.write_bytes(second.read_bytes()[:-3])
    assert tier.find(21, (None, (21,))) and tier.find(22, (None, (22,)))  # there, until read
    memory.device[0] = memory.device[1] = None
    assert not tier.load(21, (None, (21,)), 0) and not tier.load(22, (None, (22,)), 1)
    assert memory.device[:2] == [None, None]  # nothing written from a bad file
    assert tier.stats.disk_corrupt == 2 and not any(tmp_path.iterdir())
    memory.device[3] = 24
    tier.pin(())
    tier.store(3, 24, (None, (24,)))  # 23 goes down to disk intact
    assert tier.find(23, (None, (23,))) and not tier.load(23, (None, (99,)), 0)  # another key: never served
    memory.device[3] = 25
    tier.store(3, 25, (None, (25,)))  # 24 goes down, 23's file was taken by the failed read above
    assert tier.find(24, (None, (24,))) and tier.load(24, (None, (24,)), 0) and memory.device[0] == 24
    assert tier.stats.disk_loaded == 1
    tier.check_invariants()


def test_the_tier_is_bounded_least_recently_used_first_and_keeps_what_a_load_reads():
    memory = FakeMemory(4, 2)
    tier = HostPrefixTier(2, memory)
    for page, h in enumerate((11, 12)):
        memory.device[page] = h
        tier.store(page, h, (h,))
    assert tier.lookup(11, (11,)) and not tier.lookup(11, (99,))  # a colliding hash is a miss
    tier.load(11, (11,), 3)  # 11 used: 12 is the least recently used now
    memory.device[2] = 13
    tier.store(2, 13, (13,))
    assert [tier.lookup(h, (h,)) for h in (11, 12, 13)] == [True, False, True]
    assert (tier.stats.stored, tier.stats.loaded, tier.stats.dropped) == (3, 1, 1)
    tier.pin([11, 13])  # both about to be read: nothing may go
    memory.device[0] = 14
    tier.store(0, 14, (14,))
    assert not tier.lookup(14, (14,)) and tier.lookup(11, (11,)) and tier.lookup(13, (13,))
    tier.pin(())
    tier.check_invariants()


def test_the_tier_needs_prefix_caching_and_one_kv_group():
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(kv_offloading_size=1.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match=">= 0"):
        EngineConfig(kv_offloading_size=-1.0)
    with pytest.raises(ValueError, match="needs kv_offloading_size"):
        EngineConfig(kv_offloading_disk_size=1.0)
    with pytest.raises(ValueError, match="one KV group"):
        KVCacheManager(8, BLOCK, windows=(0, 16), offload=HostPrefixTier(4, FakeMemory(8, 4)))


@pytest.mark.parametrize("compiled", [False, True])
def test_a_prompt_evicted_from_the_pool_comes_back_from_the_tier_exact(make_llm, tiny_model_dirs, llama_reference,
                                                                      compiled):
    """A 40-token prompt, then three others that need the whole 32-page pool: the first prompt's
    pages are evicted into the tier, and sent again it is served from there (its 9 full blocks
    but the last token's) with transformers' greedy tokens, as are the others."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(40)] for _ in range(4)]
    llm = make_llm(tiny_model_dirs["llama"], num_gpu_blocks=32, block_size=BLOCK, kv_offloading_size=0.001,
                   enforce_eager=not compiled)
    tier = llm.engine.kv.offload
    outs = [llm.generate([p], params)[0] for p in prompts]
    assert tier.stats.stored >= 9
    again = llm.generate([prompts[0]], params)[0]
    assert again.num_cached_tokens == 36 and tier.stats.loaded >= 9
    assert [o.token_ids for o in outs] == [llama_reference.greedy(p, 6) for p in prompts]
    assert again.token_ids == outs[0].token_ids
    llm.engine.kv.check_invariants()
    # What a worker exports of it (splitserve:kv_offload_pages by op).
    from prometheus_client import CollectorRegistry
    from splitserve.common.metrics import EngineMetrics
    registry = CollectorRegistry()
    EngineMetrics(registry, "both").refresh_counters(llm.engine)
    from splitserve.common.metrics import OFFLOAD_SERIES
    assert set(tier.stats.by_tier()) == set(OFFLOAD_SERIES)
    for (name, op), value in tier.stats.by_tier().items():
        assert registry.get_sample_value("splitserve:kv_offload_pages_total", {"tier": name, "op": op}) == value
    assert value == 0 and tier.stats.loaded > 0  # no disk tier here; the host tier's loads counted
    assert registry.get_sample_value("splitserve:kv_offload_load_seconds_total") == tier.stats.load_seconds > 0


def test_without_the_tier_the_same_prompt_is_computed_again(make_llm, tiny_model_dirs):
    """The control: the same sequence with no tier finds nothing of the first prompt."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(40)] for _ in range(4)]
    llm = make_llm(tiny_model_dirs["llama"], num_gpu_blocks=32, block_size=BLOCK)
    for p in prompts:
        llm.generate([p], params)
    assert llm.generate([prompts[0]], params)[0].num_cached_tokens == 0


def test_a_prompt_dropped_to_the_disk_tier_comes_back_exact_and_its_files_go_with_the_engine(
        tiny_model_dirs, llama_reference, tmp_path):
    """A host tier of a few pages over a disk tier: the first prompt's pages go pool -> host ->
    disk, and sent again it is served from disk with transformers' tokens. Then every file on
    disk is corrupted: the prompt sent once more is computed again, still exact. Closing the
    engine removes its directory."""
    from splitserve.engine import LLM
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(40)] for _ in range(4)]
    llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", enforce_eager=True, num_gpu_blocks=32,
              block_size=BLOCK, kv_offloading_size=8192 / 2**30, kv_offloading_disk_size=0.001,
              kv_offloading_dir=str(tmp_path))
    tier = llm.engine.kv.offload
    assert tier.num_slots < 9  # the 9 full blocks of a prompt cannot all stay in host memory
    outs = [llm.generate([p], params)[0] for p in prompts]
    want = [llama_reference.greedy(p, 6) for p in prompts]
    assert [o.token_ids for o in outs] == want and tier.stats.disk_stored >= 9
    again = llm.generate([prompts[0]], params)[0]
    assert (again.token_ids, again.num_cached_tokens) == (want[0], 36) and tier.stats.disk_loaded >= 9 - tier.num_slots
    for p in prompts[1:]:  # push the first prompt's pages down again
        llm.generate([p], params)
    (directory,) = list(tmp_path.iterdir())
    for path in directory.iterdir():
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    last = llm.generate([prompts[0]], params)[0]
    assert last.token_ids == want[0] and last.num_cached_tokens < 36 and tier.stats.disk_corrupt > 0
    llm.engine.kv.check_invariants()
    llm.engine.close()
    assert not directory.exists()


def test_swap_preemption_goes_through_the_host_tier(make_llm, tiny_model_dirs):
    """With the tier, swap preemption moves requests' pages into the tier's memory (taking room
    from its least recently used prefix pages) and back, copied at once: a pool too small for 8
    requests swaps, and the output equals an engine with room for everyone's."""
    from splitserve.engine.kv_offload import SwapSlots
    from tests.harness.prompts import mixed_prompts
    model = tiny_model_dirs["llama"]
    prompts = mixed_prompts(8, seed=21, lo=20, hi=35)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    roomy = make_llm(model, block_size=8, num_gpu_blocks=256).generate(prompts, params)
    llm = make_llm(model, block_size=8, num_gpu_blocks=12, preemption_mode="swap", kv_offloading_size=24 * 2048 / 2**30)
    swap = llm.engine.kv.cpu_pool
    assert isinstance(swap, SwapSlots) and llm.engine.runner.cpu_cache is None  # no pool of its own
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0 and swap.pages_out > 0 and swap.pages_in == swap.pages_out
    assert [o.token_ids for o in outputs] == [o.token_ids for o in roomy]
    llm.engine.kv.check_invariants()


def test_a_tier_hit_loads_while_other_requests_step(make_llm, tiny_model_dirs, llama_reference):
    """The loader's copies held back (a gate on the host pages' copy in its thread): a request
    whose prefix is in the tier waits while a running one keeps decoding, step after step; let go,
    it is served from the tier with transformers' tokens, as the other is."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(40)] for _ in range(4)]
    llm = make_llm(tiny_model_dirs["llama"], num_gpu_blocks=32, block_size=BLOCK, kv_offloading_size=0.001)
    engine = llm.engine
    for p in prompts:  # the first prompt's pages go to the tier
        llm.generate([p], params)
    gate = threading.Event()
    copier = engine.kv.offload.copier
    load = copier.load

    def gated_load(slot, page):
        if threading.current_thread().name.startswith("kv-load"):
            assert gate.wait(60)
        load(slot, page)
    copier.load = gated_load
    running = [7, 8, 9, 10]
    engine.add_request("running", running, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    outputs = {}

    def step():
        for out in engine.step():
            outputs[out.request_id] = out
    step()
    engine.add_request("again", prompts[0], params)
    for _ in range(8):
        step()
    assert len(outputs["running"].token_ids) >= 9  # it went on, a token a step
    assert "again" not in outputs and engine.scheduler.num_deferred_for_load >= 8
    gate.set()
    while engine.has_unfinished_requests():
        step()
    assert outputs["again"].num_cached_tokens == 36 and engine.kv.offload.stats.loaded >= 9
    assert outputs["again"].token_ids == llama_reference.greedy(prompts[0], 6)
    assert outputs["running"].token_ids == llama_reference.greedy(running, 24)


def test_a_load_keeps_the_prefix_head_it_continues():
    """Making room for a load must not evict the pool's pages of the same prefix (they are the
    least recently freed here): the load holds them until it ends, and the whole prefix is a
    device hit after it."""
    memory = FakeMemory(9, 8)
    kv = KVCacheManager(9, BLOCK, offload=HostPrefixTier(8, memory), overlap_loads=True)
    first, other = list(range(1, 26)), list(range(100, 125))  # 6 full blocks each, and a token
    for rid, tokens in (("a", first), ("b", other)):  # b pushes a's last 4 blocks into the tier
        kv.allocate(rid, len(tokens), kv.find_cached_prefix(tokens))
        for i, h in enumerate(block_hashes(tokens)):
            memory.device[kv.block_table(rid)[i]] = h
        kv.cache_full_blocks(rid, tokens, len(tokens))
        kv.free(rid)
    head = kv.find_cached_prefix(first)
    assert len(head) == 2
    assert kv.loader.start(first, head, inline_below_s=0)
    kv.check_invariants()
    while kv.loader.busy:
        kv.loader.finish(wait=True)
    hit = kv.find_cached_prefix(first)
    assert hit[:2] == head and [memory.device[p] for p in hit] == block_hashes(first)
    kv.assert_idle()


def test_nothing_is_tracked_for_the_directory_until_someone_publishes():
    """An engine nobody publishes for (offline, no Redis) keeps no record of the blocks it cached;
    the first delta starts from everything held then."""
    memory = FakeMemory(8, 8)
    kv = KVCacheManager(8, BLOCK, offload=HostPrefixTier(8, memory))
    tokens = list(range(1, 26))
    for rid, prompt in (("a", tokens), ("b", list(range(100, 125)))):  # b pushes some of a's into the tier
        kv.allocate(rid, len(prompt), kv.find_cached_prefix(prompt))
        kv.cache_full_blocks(rid, prompt, len(prompt))
        kv.free(rid)
    assert not kv.holdings._dirty
    first = kv.holdings.delta()
    assert first.held == held_now(kv) and first.gone == [] and HOST in first.held.values()
    more = tokens[:8] + [99, 98, 97, 96, 95]  # two cached blocks, a new one, a token
    kv.allocate("c", len(more), kv.find_cached_prefix(more))
    kv.cache_full_blocks("c", more, len(more))  # now tracked: the new block is told
    assert block_hashes(more)[2] in kv.holdings.delta().held
    kv.free("c")


def test_a_load_expected_to_be_quick_is_made_in_the_admission():
    """Until the tier has brought enough pages back to know what one costs, a hit in it loads
    beside the step; once a load is expected to take less than INLINE_LOAD_S (here: copies in a
    list), the admission makes it at once; a tier whose pages cost more goes beside the step."""
    memory = FakeMemory(40, 40)
    kv = KVCacheManager(40, BLOCK, offload=HostPrefixTier(40, memory), overlap_loads=True)
    fresh = iter(range(1, 100))

    def cache(tokens):
        rid = f"r{next(fresh)}"
        kv.allocate(rid, len(tokens), kv.find_cached_prefix(tokens, load=True))
        for i, h in enumerate(block_hashes(tokens)):
            memory.device[kv.block_table(rid)[i]] = h
        kv.cache_full_blocks(rid, tokens, len(tokens))
        kv.free(rid)

    def push_out(tokens):
        """Other prompts until ``tokens`` lost most blocks from the pool (to the tier); its head left."""
        cache(tokens)
        while len(kv.find_cached_prefix(tokens)) > 2:
            n = next(fresh)
            cache(list(range(1000 * n, 1000 * n + 41)))
        return kv.find_cached_prefix(tokens)
    prompts = [list(range(100 * n, 100 * n + 41)) for n in range(1, 4)]  # 10 full blocks each, a token
    assert kv.loader.start(prompts[0], push_out(prompts[0]))  # nothing measured yet: beside the step
    while kv.loader.busy:
        kv.loader.finish(wait=True)
    assert kv.offload.stats.page_seconds(disk=False) is not None  # enough pages measured
    head = push_out(prompts[1])
    assert not kv.loader.start(prompts[1], head)  # microseconds a page: in the admission
    assert [memory.device[p] for p in kv.find_cached_prefix(prompts[1], load=True)] == block_hashes(prompts[1])[:10]
    kv.offload.stats.host_copy_seconds = 0.01 * kv.offload.stats.loaded  # as if pages cost 10 ms each
    assert kv.loader.start(prompts[2], push_out(prompts[2]))  # beside the step
    kv.loader.close()
    kv.assert_idle()
