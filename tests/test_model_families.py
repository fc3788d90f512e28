"""Every architecture of the engine's registry is served exactly, and every other one is refused
(issue 34, points 3 and 4).

For each supported architecture a tiny random model (``tests/harness/model_families.py``) is
served by the engine in fp32 and its greedy output compared with ``transformers`` token for
token: prompts of 5-60 tokens in one batch, prefilled in chunks of 32 tokens, then prompts
sharing their first 24 tokens with those (prefix-cache hits), then a batch in a pool too small
for it (recompute preemption). Refused models are refused from their config alone, before
any weight loads, with the architecture and the missing feature named.
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.model_registry import SUPPORTED, UnsupportedModel, final_logits
from tests.harness.model_families import FAMILIES, make_family_model
from tests.harness.tiny_models import byte_tokenizer
from tests.test_engine_correctness import mixed_prompts

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = make_family_model(root / name.replace("/", "-"), name)
        return made[name]
    return get


def test_every_supported_architecture_has_a_tiny_model_in_the_tests():
    assert set(SUPPORTED) <= set(FAMILIES), "an architecture in the registry without a test of it"


def served(llm, prompts):
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("arch", sorted(SUPPORTED))
def test_supported_architecture_matches_transformers(arch, family_dirs, hf_reference, make_llm):
    model = family_dirs(arch)
    reference = hf_reference(model)
    first = mixed_prompts(8, seed=34, lo=5, hi=60)
    again = [p[:24] + q for p, q in zip(first, mixed_prompts(8, seed=35, lo=1, hi=20)) if len(p) >= 24]
    expected_first = [reference.greedy(p, MAX_TOKENS) for p in first]
    # Chunked prefill (32 tokens a step), then prefix-cache hits.
    llm = make_llm(model, block_size=8, num_gpu_blocks=256, max_num_batched_tokens=32)
    assert served(llm, first) == expected_first
    assert served(llm, again) == [reference.greedy(p, MAX_TOKENS) for p in again]
    assert llm.engine.stats()["prefix_cache_hit_rate"] > 0
    # 12 pages of 8 tokens cannot hold 8 sequences growing to ~40 tokens: some are preempted and
    # computed again.
    small = make_llm(model, block_size=8, num_gpu_blocks=12)
    crowded = mixed_prompts(8, seed=21, lo=20, hi=35)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert [o.token_ids for o in small.generate(crowded, params)] == [reference.greedy(p, 16) for p in crowded]
    assert small.engine.stats()["num_preemptions"] > 0


def config_only(path, config) -> str:
    """A checkpoint directory with a config and a tokenizer and no weights at all."""
    path.mkdir()
    config.architectures = [config.architectures[0]] if config.architectures else None
    (path / "config.json").write_text(config.to_json_string())
    byte_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("arch, config, missing", [
    ("Gemma2ForCausalLM", transformers.Gemma2Config(), "soft-capping of attention scores"),
    ("GptOssForCausalLM", transformers.GptOssConfig(), "attention sinks"),
    ("DeepseekV3ForCausalLM", transformers.DeepseekV3Config(), "multi-head latent attention"),
    ("MambaForCausalLM", transformers.MambaConfig(), "state-space layers"),
    ("T5ForConditionalGeneration", transformers.T5Config(), "encoder-decoder"),
    ("FalconForCausalLM", transformers.FalconConfig(), "nobody has checked"),
])
def test_other_architectures_are_refused_before_any_weight_loads(arch, config, missing, tmp_path):
    config.architectures = [arch]
    with pytest.raises(UnsupportedModel) as refused:
        LLM(model=config_only(tmp_path / "m", config), dtype="float32", enforce_eager=True)
    assert str(refused.value).startswith(f"{arch} is not supported") and missing in str(refused.value)


def test_a_sliding_window_is_refused_past_it_and_served_exactly_within_it(family_dirs, hf_reference, make_llm):
    """A window of 16 tokens that the engine would ignore: refused for a max_model_len past it
    (0 of 8 prompts came out right before), exact when max_model_len keeps every sequence in it."""
    model = family_dirs("MistralForCausalLM/window")
    with pytest.raises(UnsupportedModel, match="sliding_window=16 .* --max-model-len 16 or less"):
        make_llm(model, num_gpu_blocks=64)
    llm = make_llm(model, num_gpu_blocks=64, max_model_len=16, max_num_batched_tokens=16)
    prompts = mixed_prompts(6, seed=16, lo=1, hi=6)
    assert served(llm, prompts) == [hf_reference(model).greedy(p, MAX_TOKENS) for p in prompts]


def test_logits_go_through_the_models_own_head(family_dirs, make_llm):
    """Granite divides its logits by logits_scaling after the projection (Gemma 2 soft-caps them):
    greedy choices do not show it, logprobs do. The engine's logprobs equal transformers'."""
    model = family_dirs("GraniteForCausalLM")
    config = json.loads((model / "config.json").read_text())
    assert config["logits_scaling"] == 4.0 and final_logits(transformers.GraniteConfig(**config)) is not None
    prompt = mixed_prompts(1, seed=7, lo=12, hi=12)[0]
    llm = make_llm(model, num_gpu_blocks=64)
    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=3))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
    top = expected.topk(3)
    got = dict(out.logprobs[0])
    assert set(got) >= set(top.indices.tolist())
    for token, logprob in zip(top.indices.tolist(), top.values.tolist()):
        assert got[token] == pytest.approx(logprob, abs=1e-4)


def test_a_worker_refuses_an_unsupported_model_in_one_line(tmp_path):
    """``splitserve decode`` with such a checkpoint: exit 1, the reason on one line, no traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    config = transformers.Gemma2Config()
    config.architectures = ["Gemma2ForCausalLM"]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "splitserve.cli", "decode", "--model",
                             config_only(tmp_path / "m", config)], capture_output=True, text=True, timeout=300,
                            env=env, cwd=root)
    assert result.returncode == 1, result.stderr
    assert "Error: Gemma2ForCausalLM is not supported" in result.stderr and "Traceback" not in result.stderr


def test_dummy_weights_from_a_config_alone(family_dirs, tmp_path, make_llm):
    """``load_format="dummy"`` (``--load-format dummy``): a checkpoint directory with no weights is
    served with random ones built from its config, for measuring a model's shapes without it."""
    import shutil

    from splitserve.engine.config import EngineConfig
    path = tmp_path / "no-weights"
    shutil.copytree(family_dirs("LlamaForCausalLM"), path)
    for weights in path.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(OSError):
        make_llm(path, num_gpu_blocks=16)  # the checkpoint's weights: there are none
    llm = make_llm(path, num_gpu_blocks=16, load_format="dummy")
    [out] = llm.generate([[1, 2, 3]], GREEDY)
    assert len(out.token_ids) == MAX_TOKENS
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(model="m", load_format="pt")
