"""The offline API and the worker-facing calls: prompts, finish reasons, seeds, logprobs, abort, bad input."""
import pytest

from splitserve.engine import SamplingParams
from tests.test_engine_correctness import mixed_prompts


@pytest.fixture
def llm(tiny_model_dirs, make_llm):
    return make_llm(tiny_model_dirs["llama"], block_size=8, num_gpu_blocks=64)


def test_text_prompt_and_text_output(llm, hf_reference, tiny_model_dirs):
    [out] = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    tokenizer = llm.get_tokenizer()
    assert out.prompt == "hello world"
    assert out.prompt_token_ids == tokenizer.encode("hello world")
    assert out.token_ids == hf_reference(tiny_model_dirs["llama"]).greedy(out.prompt_token_ids, 6)
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_stop_token_ids_and_eos_finish_reasons(llm, hf_reference, tiny_model_dirs):
    prompt = mixed_prompts(1, seed=4)[0]
    full = hf_reference(tiny_model_dirs["llama"]).greedy(prompt, 10)
    stop_at = full[3]
    first = full.index(stop_at)
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]))
    assert out.finish_reason == "stop" and out.token_ids == full[:first + 1]
    # The same token declared the model's EOS ends it with reason "eos".
    original = llm.engine.runner.eos_token_ids
    llm.engine.runner.eos_token_ids = frozenset({stop_at})
    try:
        [eos] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10))
    finally:
        llm.engine.runner.eos_token_ids = original
    assert eos.finish_reason == "eos" and eos.token_ids[-1] == stop_at


def test_same_seed_same_output_whatever_the_batch(llm):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    [alone] = llm.generate([prompt], seeded)
    others = mixed_prompts(5, seed=9)
    batch = llm.generate(others[:2] + [prompt] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=12)] * 2 + [seeded]
                         + [SamplingParams(temperature=0.7, max_tokens=5)] * 3)
    assert batch[2].token_ids == alone.token_ids
    [other_seed] = llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12,
                                                         ignore_eos=True))
    assert other_seed.token_ids != alone.token_ids


def test_logprobs(llm):
    [out] = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry[0][0] == token
        top = entry[1:]
        assert len(top) == 3
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert top[0][0] == token  # greedy: the sampled token is the most likely one
        assert all(lp <= 0 for _, lp in entry)


def test_abort_mid_decode_returns_pages(llm):
    engine = llm.engine
    free0 = engine.kv.num_free_blocks
    for i, p in enumerate(mixed_prompts(3, seed=2, lo=20, hi=30)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv.num_free_blocks < free0
    aborted = engine.abort_request("r1")
    assert aborted.finished and aborted.finish_reason == "aborted"
    assert engine.abort_request("r1") is None  # unknown now
    assert engine.abort_request("never-added") is None
    engine.abort_request("r0")
    engine.abort_request("r2")
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == free0


def test_abort_a_waiting_request(llm):
    engine = llm.engine
    engine.add_request("w", [1, 2, 3], SamplingParams(max_tokens=3))
    assert engine.abort_request("w").finish_reason == "aborted"
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt"),
    ([], "prompt"),
    ([1, 2, 10_000], "vocabulary"),
    ([1, -1], "vocabulary"),
    (list(range(200)) * 6, "max_model_len"),
])
def test_bad_prompts_raise_value_error(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt] if not isinstance(prompt, str) else prompt, SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_request_that_can_never_fit_the_pool_is_refused(llm):
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=600))


def test_bad_sampling_params_name_the_field():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_bad_engine_config_says_what_to_change():
    from splitserve.engine import EngineConfig
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=12)
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        EngineConfig(preemption_mode="swap", num_cpu_blocks=0)


def test_failed_generate_leaves_nothing_queued(llm):
    with pytest.raises(ValueError):
        llm.generate([[1, 2], [3, 10_000]], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
