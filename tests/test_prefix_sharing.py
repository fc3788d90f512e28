"""In-batch prefix sharing: a waiting request whose next uncached prompt block a running prefill is
computing waits a step and then reads it from the prefix cache. Scheduler and KV manager only, no model."""
import itertools

from splitserve.engine import SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.request import FinishReason, Request
from splitserve.engine.scheduler import SampledToken, Scheduler

BLOCK = 16
PREFIX = list(range(1000, 1064))  # 4 full blocks
_clock = itertools.count()


def make_scheduler(num_blocks=64, caching=True, **config):
    config = EngineConfig(block_size=BLOCK, num_gpu_blocks=num_blocks, enable_prefix_caching=caching,
                          num_cpu_blocks=0, **config)
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=caching)
    return Scheduler(config, kv, max_model_len=4096, clock=lambda: 0.0)


def make_request(rid, prompt, max_tokens=2):
    # Distinct arrival times keep the order the requests were added in.
    return Request(rid, list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=float(next(_clock)))


def step(sched):
    """One step with a fake forward: every sampling chunk gets token 7. Returns {rid: (start, n)}."""
    out = sched.schedule()
    sched.update(out, {c.request.request_id: [SampledToken(7)] for c in out.chunks if c.samples})
    return {c.request.request_id: (c.start, c.num_tokens) for c in out.chunks}


def prefill_steps(sched):
    """Run to the end; the prefill chunks of every step (decodes left out)."""
    steps = []
    while sched.has_unfinished():
        steps.append({rid: span for rid, span in step(sched).items() if span[1] > 1})
    sched.kv.assert_idle()
    return steps


def test_shared_prefix_is_computed_once_and_others_wait_one_step():
    sched = make_scheduler()
    suffixes = [[i] * 10 for i in range(4)]
    for i, suffix in enumerate(suffixes):
        sched.add(make_request(f"r{i}", PREFIX + suffix))
    steps = prefill_steps(sched)
    assert steps[0] == {"r0": (0, 74)}  # budget 2048 fits all four; the other three wait
    assert steps[1] == {f"r{i}": (64, 10) for i in (1, 2, 3)}  # the prefix is a cache hit
    prefill_tokens = sum(n for s in steps for _, n in s.values())
    assert prefill_tokens == len(PREFIX) + sum(len(s) for s in suffixes)
    assert sched.num_deferred_for_prefix == 3
    stats = sched.kv.prefix_stats
    assert (stats.queries, stats.hits) == (4 * 74, 3 * 64)


def test_unrelated_request_is_admitted_past_deferred_ones():
    sched = make_scheduler()
    sched.add(make_request("a", PREFIX + [1] * 10))
    sched.add(make_request("b", PREFIX + [2] * 10))
    sched.add(make_request("other", list(range(5000, 5070))))
    first = step(sched)
    assert first == {"a": (0, 74), "other": (0, 70)}
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert step(sched)["b"] == (64, 10)


def test_partial_overlap_waits_only_for_the_shared_blocks():
    """b shares a's first two blocks only: it waits for those, then computes the rest itself."""
    sched = make_scheduler(max_num_batched_tokens=32)  # a's prompt takes 3 steps of 2 blocks
    sched.add(make_request("a", PREFIX + [1] * 10))
    sched.add(make_request("b", PREFIX[:32] + [2] * 40))
    assert step(sched) == {"a": (0, 32)}
    assert step(sched) == {"a": (32, 32)}  # a's next blocks are not b's: b may go, but no budget
    assert step(sched) == {"a": (64, 10), "b": (32, 22)}
    while sched.has_unfinished():
        step(sched)
    sched.kv.assert_idle()


def test_prefill_aborted_during_its_step_lets_the_deferred_request_compute_the_prefix():
    """The engine may abort a request between schedule() and update(): its blocks are never
    cached, and the request that waited for them computes them itself the next step."""
    sched = make_scheduler()
    a, b = make_request("a", PREFIX + [1] * 10), make_request("b", PREFIX + [2] * 10)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [c.request.request_id for c in out.chunks] == ["a"] and sched.num_deferred_for_prefix == 1
    sched.abort(a)
    sched.update(out, {"a": [SampledToken(7)]})
    assert a.finish_reason is FinishReason.ABORTED
    assert step(sched) == {"b": (0, 74)}
    while sched.has_unfinished():
        step(sched)
    assert sched.num_deferred_for_prefix == 1 and b.finish_reason is FinishReason.LENGTH
    sched.kv.assert_idle()


def test_chunked_prefill_aborted_mid_way_leaves_the_rest_of_the_prefix_to_the_next_request():
    long_prefix = list(range(2000, 2128))  # 8 blocks: 4 steps at a 32-token budget
    sched = make_scheduler(max_num_batched_tokens=32)
    a, b = make_request("a", long_prefix + [1] * 5), make_request("b", long_prefix + [2] * 5)
    sched.add(a)
    sched.add(b)
    assert step(sched) == {"a": (0, 32)}  # a takes the whole budget: b is not even looked at
    assert step(sched) == {"a": (32, 32)}
    sched.abort(a)
    assert step(sched) == {"b": (64, 32)}  # the four blocks a cached are hits; b computes the rest
    while sched.has_unfinished():
        step(sched)
    assert b.finish_reason is FinishReason.LENGTH and len(b.output_token_ids) == 2
    sched.kv.assert_idle()


def test_preempted_prefill_defers_nobody_after_it():
    """a (low priority) is finishing its chunked prefill of a prefix b shares, so b is deferred;
    then c, more urgent, takes a's pages. The step after, b is admitted and computes the block a
    never cached; later arrivals wait for b's block in turn; nothing hangs."""
    prefix = PREFIX + list(range(1064, 1080))  # 5 blocks
    sched = make_scheduler(num_blocks=7, max_num_batched_tokens=64, priority_aging_per_s=0.0)
    a = make_request("a", prefix + [1] * 5)
    a.priority = 10
    sched.add(a)
    assert step(sched) == {"a": (0, 64)}  # blocks 0-3 cached
    b, c = make_request("b", prefix + [2] * 5), make_request("c", list(range(5000, 5040)))
    sched.add(b)
    sched.add(c)
    chunks = step(sched)  # a's last chunk would compute block 4: b waits; c has no room but a's
    assert chunks == {"c": (0, 40)}
    assert a.num_preemptions == 1 and b in sched.waiting and sched.num_deferred_for_prefix == 1
    chunks = step(sched)
    assert chunks["b"] == (64, 21)  # b computes block 4 itself
    for _ in range(100):
        if not sched.has_unfinished():
            break
        step(sched)
    assert not sched.has_unfinished()
    assert all(r.finish_reason is FinishReason.LENGTH for r in (a, b, c))
    sched.kv.assert_idle()


def test_without_prefix_caching_everyone_computes_the_prefix():
    sched = make_scheduler(caching=False)
    for i in range(4):
        sched.add(make_request(f"r{i}", PREFIX + [i] * 10))
    steps = prefill_steps(sched)
    assert steps[0] == {f"r{i}": (0, 74) for i in range(4)}
    assert sched.num_deferred_for_prefix == 0


def test_static_batching_admits_the_whole_batch():
    sched = make_scheduler(batching="static", static_batch_size=4)
    for i in range(4):
        sched.add(make_request(f"r{i}", PREFIX + [i] * 10))
    assert step(sched) == {f"r{i}": (0, 74) for i in range(4)}
    while sched.has_unfinished():
        step(sched)
    assert sched.num_deferred_for_prefix == 0
    sched.kv.assert_idle()
