"""The engine gives windowed layers' pages back behind the window (issue 34, point 1: KV memory
for windowed layers), exactly: a Gemma-3-shaped tiny model of eight layers (two full, six
windowed: a full group and three windowed ones of two layers each) against ``transformers`` in fp32, over prompts
up to six times its window, chunked, with prefix-cache hits, in a pool so small that freed pages
go to other requests at once, and under recompute preemption; and a request the same memory
cannot hold when every page is kept."""
from __future__ import annotations

import pytest

from splitserve.engine import SamplingParams
from splitserve.engine.kv_groups import window_pages
from tests.harness.model_families import WINDOW, make_family_model
from tests.test_engine_correctness import mixed_prompts

# 2 full, 6 windowed layers -> groups of 2 layers: one full group, three windowed ones.
LAYER_TYPES = (["sliding_attention"] * 3 + ["full_attention"]) * 2


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return make_family_model(tmp_path_factory.mktemp("gemma3-8") / "m", "Gemma3ForCausalLM",
                             num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES)


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_the_layers_go_in_groups_by_window(gemma3, make_llm):
    llm = make_llm(gemma3, block_size=8, num_gpu_blocks=64)
    groups = llm.engine.runner.kv_groups
    assert groups.windows == (0, WINDOW, WINDOW, WINDOW)
    assert groups.slots == 2 and groups.padded_slots == 0
    assert llm.engine.kv_cache.shape[0] == 2  # the pool holds 2 layers per page
    off = make_llm(gemma3, block_size=8, num_gpu_blocks=64, disable_hybrid_kv_cache_manager=True)
    assert off.engine.runner.kv_groups.windows == (0,) and off.engine.kv_cache.shape[0] == len(LAYER_TYPES)


def test_async_scheduling_on_is_refused_where_windowed_pages_are_freed(gemma3, make_llm):
    """A step in flight may still read pages the window would give back (async_scheduling.py)."""
    with pytest.raises(ValueError, match="does not go with windowed layers freeing pages"):
        make_llm(gemma3, block_size=8, num_gpu_blocks=64, async_scheduling="on")
    kept = make_llm(gemma3, block_size=8, num_gpu_blocks=64, async_scheduling="on", disable_hybrid_kv_cache_manager=True)
    assert kept.engine.overlap is not None


def test_windowed_pages_freed_and_reused_serve_exact_tokens(gemma3, hf_reference, make_llm):
    reference = hf_reference(gemma3)
    prompts = mixed_prompts(6, seed=340, lo=30, hi=100)
    expected = [reference.greedy(p, 24) for p in prompts]
    # Chunks of 32 tokens; 6 sequences of up to 124 tokens need 6 x 16 pages in the full group
    # alone: in 120 pages, pages the windowed groups give back go to the others straight away.
    llm = make_llm(gemma3, block_size=8, num_gpu_blocks=120, max_num_batched_tokens=32)
    assert [o.token_ids for o in llm.generate(prompts, greedy(24))] == expected
    # Prefix-cache hits on prompts sharing 48 tokens (three windows) with those, in a pool where
    # the windows before token 48 stay cached.
    roomy = make_llm(gemma3, block_size=8, num_gpu_blocks=400, max_num_batched_tokens=32)
    assert [o.token_ids for o in roomy.generate(prompts, greedy(24))] == expected
    again = [p[:48] + q for p, q in zip(prompts, mixed_prompts(6, seed=341, lo=3, hi=20)) if len(p) >= 48]
    assert [o.token_ids for o in roomy.generate(again, greedy(12))] == [reference.greedy(p, 12) for p in again]
    assert roomy.engine.stats()["prefix_cache_hit_rate"] > 0.3
    # 40 pages cannot hold six such sequences at once: some are preempted and computed again.
    small = make_llm(gemma3, block_size=8, num_gpu_blocks=40, max_num_batched_tokens=32)
    assert [o.token_ids for o in small.generate(prompts, greedy(24))] == expected
    assert small.engine.stats()["num_preemptions"] > 0


def test_a_long_request_fits_the_memory_that_keeping_every_page_cannot(gemma3, hf_reference, make_llm):
    """The same KV memory: 20 pages of 8 layers kept whole, 80 pages of 2 layers grouped. A request
    of 300 tokens needs 38 pages of every layer kept, but 38 full-group pages plus, per windowed
    group, the window and a step's worth."""
    keep = make_llm(gemma3, block_size=8, num_gpu_blocks=1, disable_hybrid_kv_cache_manager=True)
    memory_gb = 20 * keep.engine.runner.kv_bytes_per_token * 8 / 2**30
    keep = make_llm(gemma3, block_size=8, kv_cache_memory_gb=memory_gb, disable_hybrid_kv_cache_manager=True,
                    max_num_batched_tokens=32)
    grouped = make_llm(gemma3, block_size=8, kv_cache_memory_gb=memory_gb, max_num_batched_tokens=32)
    assert keep.engine.kv.num_total_blocks == 20
    assert grouped.engine.kv.num_total_blocks == 80
    prompt = mixed_prompts(1, seed=342, lo=260, hi=261)[0]
    with pytest.raises(ValueError, match="cannot fit the KV cache"):
        keep.generate([prompt], greedy(40))
    assert grouped.engine.kv.blocks_needed(300) == 38 + 3 * window_pages(WINDOW, 8, 300, 32) <= 80
    out = grouped.generate([prompt], greedy(40))
    assert out[0].token_ids == hf_reference(gemma3).greedy(prompt, 40)


def test_the_compiled_step_serves_the_groups(gemma3, hf_reference, make_llm):
    prompts = mixed_prompts(3, seed=343, lo=30, hi=70)
    llm = make_llm(gemma3, block_size=8, num_gpu_blocks=64, max_num_batched_tokens=32, enforce_eager=False)
    assert [o.token_ids for o in llm.generate(prompts, greedy(8))] == \
        [hf_reference(gemma3).greedy(p, 8) for p in prompts]


def test_a_layer_attending_otherwise_than_its_group_frees_fails_loudly(gemma3):
    """Were ``layer_windows`` to read a config wrongly, pages a layer still reads would be given
    back: the op refuses the step instead of answering from them."""
    import dataclasses

    from splitserve.engine import LLM
    llm = LLM(model=str(gemma3), dtype="float32", enforce_eager=True, block_size=8, num_gpu_blocks=64)
    runner = llm.engine.runner
    runner.kv_groups = dataclasses.replace(runner.kv_groups, windows=(0, 99, 99, 99))
    with pytest.raises(RuntimeError, match="attends with sliding window 16, but its KV group frees pages behind "
                                           "a window of 99"):
        llm.generate([[5] * 20], greedy(2))


def test_the_sizing_report_counts_the_pages_a_colocated_worker_makes(gemma3, make_llm):
    import re

    from splitserve.cli.sizing import load_shape, report
    budget = 0.001
    text = report(load_shape(str(gemma3)), "float32", 8, budget, [300])
    grouped = make_llm(gemma3, block_size=8, kv_cache_memory_gb=budget)
    kept = make_llm(gemma3, block_size=8, kv_cache_memory_gb=budget, disable_hybrid_kv_cache_manager=True)
    assert f"pool of {budget:g} GiB: {kept.engine.kv.num_total_blocks:,} pages" in text
    found = re.search(r"4 groups of 2 layers\): pages of [\d,]+ B, ([\d,]+) in the pool", text)
    assert found and int(found.group(1).replace(",", "")) == grouped.engine.kv.num_total_blocks


def test_speculative_proposals_over_windowed_groups_stay_exact(gemma3, hf_reference, make_llm):
    """Proposal slots taken and given back (rejected ones trimmed) while the windows slide."""
    prompts = [list(range(40, 70)) * 2, mixed_prompts(1, seed=344, lo=60, hi=61)[0]]  # repetitive: ngram proposes
    llm = make_llm(gemma3, block_size=8, num_gpu_blocks=64, speculative_method="ngram", num_speculative_tokens=3)
    out = llm.generate(prompts, greedy(24))
    assert [o.token_ids for o in out] == [hf_reference(gemma3).greedy(p, 24) for p in prompts]
    assert llm.engine.stats()["spec_decode_num_draft_tokens"] > 0
