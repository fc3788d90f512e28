"""Windowed layers in KV groups of their own, and the cache manager giving their pages back behind
the window (issue 34: vLLM's hybrid KV cache manager). Pure Python, like the manager."""
import random

import pytest
import transformers

from splitserve.engine.kv_cache_manager import PLACEHOLDER, KVCacheManager
from splitserve.engine.kv_groups import layer_windows, one_group, plan_groups, window_pages


# ---- which layers go together ---------------------------------------------------------------
def test_gemma3_pattern_makes_groups_that_waste_little():
    """Gemma-3-1B: 26 layers, every sixth full: 4 full, 22 windowed. Groups of 4 would pad 2 slots
    (8 % of the memory of a short sequence): groups of 2 pad none (two full groups, eleven
    windowed). Gemma-3-27B: 10 full, 52 windowed: groups of 5 pad 3 slots, of 10 would pad 8."""
    config = transformers.Gemma3TextConfig(num_hidden_layers=26, sliding_window=512)
    windows = layer_windows(config)
    assert windows.count(0) == 4 and set(windows) == {0, 512}
    groups = plan_groups(windows)
    assert groups.slots == 2
    assert groups.windows == (0, 0) + (512,) * 11
    assert groups.padded_slots == 0
    assert groups.layers_of(0) == [5, 11] and groups.layers_of(1) == [17, 23]
    # Each (group, slot) holds one layer, and each layer's group has its window.
    assert len(set(groups.place)) == 26
    assert all(groups.windows[g] == windows[layer] for layer, (g, _) in enumerate(groups.place))
    big = plan_groups(layer_windows(transformers.Gemma3TextConfig(num_hidden_layers=62, sliding_window=1024)))
    assert big.slots == 5 and big.padded_slots == 3 and big.windows.count(0) == 2


def test_padding_is_only_taken_in_the_windowed_groups_and_within_bounds():
    # 3 full, 10 windowed (13 layers): groups of 3 pad 2 slots (15 %), too many: groups of 1.
    groups = plan_groups([0, 9, 9, 9, 0, 9, 9, 9, 0, 9, 9, 9, 9])
    assert groups.slots == 1 and groups.padded_slots == 0 and len(groups.windows) == 13
    # 2 full, 41 windowed: groups of 2 pad one slot of 43 (2 %).
    groups = plan_groups([0] * 2 + [9] * 41)
    assert groups.slots == 2 and groups.padded_slots == 1
    assert groups.windows == (0,) + (9,) * 21


@pytest.mark.parametrize("config, expected", [
    (transformers.GptOssConfig(num_hidden_layers=4, sliding_window=128), (0, 128)),  # alternating: no padding
    (transformers.Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=16, max_window_layers=1),
     (0, 16, 16)),
    (transformers.MistralConfig(num_hidden_layers=4, sliding_window=64), (64,)),  # every layer windowed
    (transformers.MistralConfig(num_hidden_layers=4, sliding_window=None), (0,)),
    (transformers.LlamaConfig(num_hidden_layers=4), (0,)),
])
def test_groups_of_other_layouts(config, expected):
    groups = plan_groups(layer_windows(config))
    assert groups.windows == expected
    assert groups.padded_slots == 0
    assert groups.slots * len(groups.windows) == config.num_hidden_layers


def test_one_group_keeps_every_page():
    groups = one_group(3)
    assert groups.windows == (0,) and groups.slots == 3 and not groups.frees_pages


def test_window_pages_bounds_what_a_sequence_holds():
    assert window_pages(0, 8, 100, 32) == 13
    # A step of 32 tokens after a window of 16: the 15 tokens before it and the 32, on 8-token pages.
    assert window_pages(16, 8, 1000, 32) == -(-(15 + 32) // 8) + 1
    assert window_pages(16, 8, 10, 32) == 2  # never more than the sequence's own pages


# ---- the manager over groups ----------------------------------------------------------------
def _tokens(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_windowed_group_gives_pages_back_as_the_sequence_grows():
    # Group 0 full, group 1 windowed (8 tokens), pages of 4 tokens.
    kv = KVCacheManager(num_blocks=200, block_size=4, enable_prefix_caching=False, windows=(0, 8))
    kv.allocate("a", 40)  # a 40-token prompt: 10 pages in each group
    assert kv.num_free_blocks == 200 - 20
    # Decoding from position 40: a token there reads back to 33, so pages 0..7 (tokens 0..31) go.
    assert kv.slide("a", 40) == 8
    full, windowed = kv.block_tables("a")
    assert len(full) == len(windowed) == 10
    assert windowed[:8] == [PLACEHOLDER] * 8 and PLACEHOLDER not in full[1:]
    assert kv.num_free_blocks == 200 - 12
    kv.check_invariants()
    # Decoding 400 tokens: the full group holds every page, the windowed one the pages from the
    # one holding position n - 8 (what token n - 1 reads back to) on: never more than 3.
    for n in range(41, 441):
        kv.slide("a", n - 1)
        assert kv.allocate("a", n) is not None
        pages = -(-n // 4)
        windowed_held = pages - (n - 1 - 8 + 1) // 4
        assert windowed_held <= 3
        assert kv.num_free_blocks == 200 - pages - windowed_held, n
    kv.check_invariants()
    kv.free("a")
    kv.assert_idle()


def test_a_window_never_frees_what_its_next_tokens_read():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False, windows=(0, 10))
    kv.allocate("a", 23)
    # Position 23 reads back to 14: page 3 (tokens 12..15) stays, pages 0..2 go.
    assert kv.slide("a", 23) == 3
    assert kv.block_tables("a")[1][3] != PLACEHOLDER
    assert kv.slide("a", 23) == 0  # nothing twice


def test_blocks_needed_counts_every_group_at_its_peak():
    kv = KVCacheManager(num_blocks=64, block_size=4, windows=(0, 8, 8), max_step_tokens=8)
    assert kv.blocks_needed(100) == 25 + 2 * window_pages(8, 4, 100, 8)


def test_a_prefix_hit_needs_the_window_before_its_end_in_every_group():
    kv = KVCacheManager(num_blocks=64, block_size=4, windows=(0, 8))
    prompt = _tokens(41)
    kv.allocate("a", 41)
    kv.cache_full_blocks("a", prompt, 41)
    kv.slide("a", 41)  # the windowed group gives pages 0..7 back: still cached, ref 0
    kv.free("a")
    kv.check_invariants()
    hit = kv.find_cached_prefix(prompt + [7])
    assert len(hit) == 10  # every full block of the 42 tokens but nothing of the last
    # The hit's windowed table: placeholders up to the window before token 40, pages after.
    assert hit.released == [0, 8]
    assert hit.tables[1][:8] == [PLACEHOLDER] * 8
    kv.allocate("b", 42, hit)
    assert kv.block_tables("b")[0][:10] == list(hit)
    kv.check_invariants()
    kv.free("b")
    kv.assert_idle()


def test_window_pages_evicted_take_the_hits_that_need_them():
    """A running request's windowed group gives pages 0..7 back (cached, free). A prompt sharing
    its first 28 tokens hits 7 blocks while the window before token 28 (pages 5, 6) is cached; once
    allocations evict those (oldest first), no shorter prefix has its window either: no hit. The
    running request's own prompt still hits whole: its window's pages are held."""
    kv = KVCacheManager(num_blocks=24, block_size=4, windows=(0, 8))
    prompt = _tokens(41)
    kv.allocate("a", 41)
    kv.cache_full_blocks("a", prompt, 41)
    assert kv.slide("a", 41) == 8
    other = prompt[:28] + _tokens(10, seed=1)
    assert len(kv.find_cached_prefix(other)) == 7
    kv.allocate("x", 8)  # 2 pages in each group: the 2 plain ones, then the windowed pages 0 and 1
    assert len(kv.find_cached_prefix(other)) == 7
    kv.allocate("y", 8)  # the windowed pages 2..5
    assert len(kv.find_cached_prefix(other)) == 0
    assert len(kv.find_cached_prefix(prompt + [7])) == 10
    kv.check_invariants()
    for rid in ("a", "x", "y"):
        kv.free(rid)
    kv.assert_idle()


def test_trim_and_free_skip_the_placeholders():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False, windows=(0, 8))
    kv.allocate("a", 40)
    kv.slide("a", 40)
    kv.allocate("a", 48)  # speculative slots
    kv.trim("a", 41)
    assert [len(t) for t in kv.block_tables("a")] == [11, 11]
    kv.check_invariants()
    kv.free("a")
    kv.assert_idle()


def test_swap_preemption_needs_one_group():
    with pytest.raises(ValueError, match="one KV group"):
        KVCacheManager(8, 4, num_cpu_blocks=4, windows=(0, 8))


def test_random_traffic_keeps_the_books(seed=3):
    """Allocations, slides, prefix hits and frees at random over three groups: ref counts always
    match the tables, and everything comes back."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=120, block_size=4, windows=(0, 6, 6), max_step_tokens=8)
    heads = [_tokens(30, seed=s) for s in range(3)]
    live: dict[str, tuple[list[int], int]] = {}
    for i in range(400):
        if live and rng.random() < 0.3:
            rid = rng.choice(sorted(live))
            tokens, n = live.pop(rid)
            kv.cache_full_blocks(rid, tokens, n)
            kv.free(rid)
        elif live and rng.random() < 0.6:
            rid = rng.choice(sorted(live))
            tokens, n = live[rid]
            kv.slide(rid, n)
            step = rng.randint(1, 8)
            if kv.allocate(rid, n + step) is not None:
                tokens = tokens + _tokens(step, seed=i)
                kv.cache_full_blocks(rid, tokens, n + step)
                live[rid] = (tokens, n + step)
        else:
            tokens = rng.choice(heads)[:rng.randint(5, 30)] + _tokens(rng.randint(1, 9), seed=1000 + i)
            hit = kv.find_cached_prefix(tokens)
            start = len(hit) * 4
            if kv.allocate(f"r{i}", len(tokens), hit) is not None:
                kv.cache_full_blocks(f"r{i}", tokens, len(tokens))
                live[f"r{i}"] = (tokens, len(tokens))
                assert start < len(tokens)
        kv.check_invariants()
    for rid in list(live):
        kv.free(rid)
    kv.assert_idle()
