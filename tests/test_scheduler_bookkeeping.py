"""What the scheduler counts and frees: prefix-cache counters count each admitted request once,
and a static batch gives its pages back as soon as it is over."""
from splitserve.engine import SamplingParams
from tests.harness.prompts import mixed_prompts


def test_prefix_cache_counters_count_each_admitted_request_once(tiny_model_dirs, make_llm):
    """A request that waits for pages is looked up at every step it does not fit, but counted
    once, when admitted; hits are exactly the cached full blocks."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = make_llm(tiny_model_dirs["llama"], block_size=8, num_gpu_blocks=8, max_num_seqs=2)
    engine = llm.engine
    a, b = mixed_prompts(2, seed=41, lo=40, hi=40)
    engine.add_request("a", a, params)
    engine.step()  # a runs: 6 of the 8 pages
    engine.add_request("b", b, params)  # needs 5: waits until a is over
    steps_waiting = 0
    while engine.has_unfinished_requests():
        steps_waiting += bool(engine.scheduler.waiting)
        engine.step()
    assert steps_waiting > 2  # b's admission was tried, and failed, at several steps
    stats = engine.kv.prefix_stats
    assert (stats.queries, stats.hits) == (len(a) + len(b), 0)

    llm = make_llm(tiny_model_dirs["llama"], block_size=8, num_gpu_blocks=64)
    prompt = mixed_prompts(1, seed=42, lo=41, hi=41)[0]
    first, again = llm.generate([prompt], params), llm.generate([prompt], params)
    assert first[0].num_cached_tokens == 0 and again[0].num_cached_tokens == 40  # the last token is computed
    stats = llm.engine.kv.prefix_stats
    assert (stats.queries, stats.hits) == (2 * 41, 40)


def test_static_batching_frees_its_last_batch_when_generate_returns(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"], block_size=8, num_gpu_blocks=64, batching="static", static_batch_size=4)
    outs = llm.generate(mixed_prompts(6, seed=43), [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                                                    for n in (3, 9, 5, 2, 7, 4)])
    assert [len(o.token_ids) for o in outs] == [3, 9, 5, 2, 7, 4]
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_total_blocks and not llm.engine.scheduler.running
