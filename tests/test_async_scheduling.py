"""Async scheduling (splitserve/engine/async_scheduling.py): step N+1 is planned, built and launched
before step N's tokens are read, its input ids copied from them on the device.

On a CPU a launched step has run by the time ``launch`` returns, so these tests check what the
overlap must keep: the tokens (transformers' greedy output; the synchronous engine's for seeded
sampling), stops in the step behind, aborts while a step is in flight (joins:
test_engine_correctness), and pages held until the step that may write them has landed. The last
test runs the same on a GPU, where "auto" turns it on."""
import pytest
import torch

from splitserve.engine import SamplingParams
from splitserve.engine.async_scheduling import plan_ahead
from tests.test_engine_correctness import MAX_TOKENS, assert_matches, mixed_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_greedy_batches_match_transformers_and_overlap(tiny_model_dirs, make_llm, hf_reference, step_mode):
    model = tiny_model_dirs["llama"]
    prompts = mixed_prompts(12, seed=5)
    llm = make_llm(model, block_size=8, num_gpu_blocks=256, async_scheduling="on", **step_mode)
    assert_matches(llm.generate(prompts, GREEDY), prompts, hf_reference(model))
    # One prefill step for the batch, then its decodes: all but the first launched ahead of the
    # tokens before them (the requests reaching max_tokens leave no step to overlap at the end).
    assert llm.engine.overlap.num_overlapped >= MAX_TOKENS - 3


def test_cpu_leaves_it_off_unless_asked(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"], num_gpu_blocks=16)
    assert llm.engine.config.async_scheduling == "auto" and llm.engine.overlap is None


@pytest.mark.parametrize("conflict, named", [({"speculative_method": "ngram"}, "speculative decoding"),
                                              ({"batching": "static"}, "static batching"),
                                              ({"tensor_parallel_size": 2}, "tensor parallelism"),
                                              ({"enable_lora": True}, "LoRA"),
                                              ({"target_tpot_ms": 50.0}, "target_tpot_ms")])
def test_on_with_what_rules_it_out_is_refused_before_a_model_loads(conflict, named):
    from splitserve.engine.config import EngineConfig
    with pytest.raises(ValueError, match=f"async_scheduling='on' does not go with {named}"):
        EngineConfig(async_scheduling="on", **conflict)
    assert EngineConfig(async_scheduling="auto", **conflict).async_scheduling_blocker()


def test_unknown_value_is_refused():
    from splitserve.engine.config import EngineConfig
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")


def _pair(make_llm, model, **kwargs):
    return (make_llm(model, block_size=8, num_gpu_blocks=256, async_scheduling=mode, **kwargs) for mode in ("off", "on"))


def test_sampling_mixes_give_the_synchronous_engines_tokens(tiny_model_dirs, make_llm):
    """Seeded random rows, greedy rows, and rows that read their history (penalties, logprobs,
    min_tokens: those steps run synchronously) in one batch: each request's tokens are the
    synchronous engine's."""
    model = tiny_model_dirs["llama"]
    prompts = mixed_prompts(8, seed=7)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=i, max_tokens=12, ignore_eos=True)
              for i in range(4)]
    params += [GREEDY, SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
               SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True),
               SamplingParams(temperature=0.7, seed=9, max_tokens=12, min_tokens=6, ignore_eos=True)]
    sync, overlapped = _pair(make_llm, model)
    expected = sync.generate(prompts, params)
    got = overlapped.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.logprobs for o in got] == [o.logprobs for o in expected]
    # Alone, the history-free requests overlap; with the others they take the synchronous steps.
    solo = overlapped.generate(prompts[:5], params[:5])
    assert [o.token_ids for o in solo] == [o.token_ids for o in expected[:5]]
    assert overlapped.engine.overlap.num_overlapped > 0


def test_a_stop_in_the_step_behind_is_discarded(tiny_model_dirs, make_llm):
    """Requests that stop on a token (not at max_tokens) are one step into the next launch when the
    host sees it: that row is dropped, their pages come back after it lands, and the others go on."""
    model = tiny_model_dirs["llama"]
    prompts = mixed_prompts(6, seed=8)
    sync, overlapped = _pair(make_llm, model)
    greedy = sync.generate(prompts, GREEDY)
    # Each request stops at its own 4th greedy token (as a stop token id), or goes on to 10.
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             stop_token_ids=[o.token_ids[3]] if i % 2 == 0 else []) for i, o in enumerate(greedy)]
    expected = sync.generate(prompts, params)
    got = overlapped.generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in expected]
    assert any(o.finish_reason == "stop" for o in got)  # make_llm then checks every page came back


def test_an_abort_while_in_flight_keeps_the_pages_until_the_step_lands(tiny_model_dirs, make_llm, hf_reference):
    model = tiny_model_dirs["llama"]
    llm = make_llm(model, block_size=8, num_gpu_blocks=128, async_scheduling="on")
    engine = llm.engine
    prompts = mixed_prompts(3, seed=4)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    assert engine.step() == []  # the prefill step, launched
    engine.step()  # its tokens read; the first decode step launched ahead of them
    assert engine.overlap.in_flight is not None
    assert "r1" in {c.request.request_id for c in engine.overlap.in_flight.plan.chunks}
    free_before = engine.kv.num_free_blocks
    aborted = engine.abort_request("r1")
    assert aborted.finished and aborted.finish_reason == "aborted"
    # The step in flight still writes r1's page of this step: its pages stay out of the pool, under
    # an id of their own, so releasing "r1" again (a worker's Abort after its stream's cancel) finds
    # nothing to free, and a retry may reserve under "r1" at once.
    [holder] = engine.scheduler.held_pages
    assert engine.kv.owns(holder) and not engine.kv.owns("r1") and engine.kv.num_free_blocks == free_before
    assert engine.release_pages("r1") is False and engine.kv.num_free_blocks == free_before
    old_pages = engine.overlap.in_flight.plan.block_tables["r1"]
    retry, _ = engine.reserve_pages("r1", 10)
    assert not set(retry) & set(old_pages)
    engine.step()  # that step lands (r1's row is dropped), and only then its old pages go back
    assert not engine.kv.owns(holder)
    assert engine.kv.block_table("r1") == retry  # the retry's reservation is untouched
    assert engine.release_pages("r1")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert set(done) == {"r0", "r2"}
    for i in (0, 2):
        assert done[f"r{i}"].token_ids == hf_reference(model).greedy(prompts[i], MAX_TOKENS)


def test_no_plan_ahead_while_someone_waits_or_a_prompt_is_half_done(tiny_model_dirs, make_llm):
    """The overlap only continues the launched step: a waiting request or a prefill chunk that does
    not sample yet means the next step is scheduled as usual, after the tokens are read."""
    llm = make_llm(tiny_model_dirs["llama"], block_size=8, num_gpu_blocks=128, async_scheduling="on",
                   max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("long", list(range(1, 41)), GREEDY)  # 40 tokens: three chunks of at most 16
    assert engine.step() == []
    launched = engine.overlap.in_flight.plan
    assert not launched.chunks[0].samples and plan_ahead(engine.scheduler, launched) is None
    engine.add_request("late", [5, 6, 7], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_auto_overlaps_with_graphs_and_keeps_the_tokens(tiny_model_dirs, make_llm, hf_reference):
    """On CUDA "auto" is on: decode steps replay CUDA graphs whose input ids are copied from the
    step in flight on the device; greedy output is still transformers', seeded sampling the
    synchronous engine's."""
    model = tiny_model_dirs["llama"]
    prompts = mixed_prompts(12, seed=5)
    gpu = dict(device="cuda", block_size=16, num_gpu_blocks=256, enforce_eager=False)
    overlapped = make_llm(model, **gpu)
    assert overlapped.engine.overlap is not None and overlapped.engine.runner.graphs is not None
    assert_matches(overlapped.generate(prompts, GREEDY), prompts, hf_reference(model))
    assert overlapped.engine.overlap.num_overlapped >= MAX_TOKENS - 3
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=16, ignore_eos=True) for i in range(12)]
    sync = make_llm(model, async_scheduling="off", **gpu)
    assert [o.token_ids for o in overlapped.generate(prompts, sampled)] == \
        [o.token_ids for o in sync.generate(prompts, sampled)]


def test_land_after_aborting_everything_gives_every_page_back(tiny_model_dirs, make_llm):
    """What a caller that gives up does (``LLM.generate`` on an error, a benchmark between cells)."""
    llm = make_llm(tiny_model_dirs["llama"], block_size=8, num_gpu_blocks=64, async_scheduling="on")
    engine = llm.engine
    for i, prompt in enumerate(mixed_prompts(3, seed=6)):
        engine.add_request(f"r{i}", prompt, GREEDY)
    engine.step()
    engine.step()
    for i in range(3):
        engine.abort_request(f"r{i}")
    assert engine.has_unfinished_requests()  # the step in flight, holding their pages
    assert engine.kv.num_free_blocks < 64
    assert engine.land() == [] and not engine.has_unfinished_requests()
    engine.assert_idle()
