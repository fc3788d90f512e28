"""Priority scheduling: urgent work preempts, and aging keeps low priority from starving."""
import pytest

from splitserve.engine import EngineConfig, LLMEngine, SamplingParams
from tests.test_engine_correctness import mixed_prompts


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def make_engine():
    made = []

    def factory(model, clock, **kwargs):
        engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", scheduling_policy="priority", **kwargs),
                           clock=clock)
        made.append(engine)
        return engine

    yield factory
    for engine in made:
        engine.assert_idle()


def test_high_priority_arrival_preempts_and_finishes_first(tiny_model_dirs, make_engine, hf_reference):
    model = tiny_model_dirs["llama"]
    clock = FakeClock()
    engine = make_engine(model, clock, block_size=8, num_gpu_blocks=8)
    low = mixed_prompts(2, seed=1, lo=24, hi=24)
    long_run = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, p in enumerate(low):
        engine.add_request(f"low{i}", p, long_run, priority=10)
    order = []
    for _ in range(3):  # both low requests are running and hold most of the pool
        engine.step()
        clock.now += 0.01
    assert engine.kv.num_free_blocks < 3
    high = mixed_prompts(1, seed=2, lo=24, hi=24)[0]
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("high", high, short, priority=0)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                outputs[out.request_id] = out
        clock.now += 0.01
    assert order[0] == "high"
    assert engine.scheduler.num_preemptions >= 1
    ref = hf_reference(model)
    assert outputs["high"].token_ids == ref.greedy(high, 4)
    for i, p in enumerate(low):
        assert outputs[f"low{i}"].token_ids == ref.greedy(p, 20)


def run_stream(engine, clock, steps):
    """A steady stream of high-priority requests, one per step, with one low-priority request waiting."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("low", [5, 6, 7], params, priority=5)
    finished_low_at = None
    for step in range(steps):
        engine.add_request(f"high{step}", [8, 9, step % 200], params, priority=0)
        for out in engine.step():
            if out.request_id == "low" and out.finished:
                finished_low_at = step
        clock.now += 1.0
    for rid in list(engine.requests):
        engine.abort_request(rid)
    return finished_low_at


def test_aging_lets_low_priority_finish_under_a_high_priority_stream(tiny_model_dirs, make_engine):
    clock = FakeClock()
    engine = make_engine(tiny_model_dirs["llama"], clock, max_num_seqs=1, num_gpu_blocks=64,
                         priority_aging_per_s=1.0)
    finished_at = run_stream(engine, clock, steps=40)
    assert finished_at is not None and finished_at < 30


def test_without_aging_the_stream_starves_low_priority(tiny_model_dirs, make_engine):
    # The control for the test above: the same stream with aging off never serves "low".
    clock = FakeClock()
    engine = make_engine(tiny_model_dirs["llama"], clock, max_num_seqs=1, num_gpu_blocks=64,
                         priority_aging_per_s=0.0)
    assert run_stream(engine, clock, steps=40) is None
