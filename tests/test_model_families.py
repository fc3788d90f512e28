"""Every architecture of the engine's registry is served exactly, and every other one is refused
(issue 34, points 3 and 4).

For each supported architecture a tiny random model (``tests/harness/model_families.py``) is
served by the engine in fp32 and its greedy output compared with ``transformers`` token for
token: prompts of 5-60 tokens in one batch, prefilled in chunks of 32 tokens, then prompts
sharing their first 24 tokens with those (prefix-cache hits), then a batch in a pool too small
for it (recompute preemption), then through the disaggregated handoff (prefill engine -> shm ->
decode engine). Windows (16 tokens) are shorter than most prompts. The families with attention
variants are served by the torch attention backend as well. Refused models are refused from their config alone, before
any weight loads, with the architecture and the missing feature named.
"""
from __future__ import annotations


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


def test_every_tiny_model_decides_by_its_context(family_dirs):
    """A tiny model whose greedy choice did not depend on what came before (Gemma's tied, scaled
    embeddings made greedy repeat the input token) could not show an attention bug: for each
    family, most next-token choices over a 50-token sequence differ from those of each token alone."""
    x = torch.randint(3, 200, (2, 50), generator=torch.Generator().manual_seed(0))
    for arch in sorted(SUPPORTED):
        model = transformers.AutoModelForCausalLM.from_pretrained(family_dirs(arch), dtype=torch.float32).eval()
        with torch.no_grad():
            in_context = model(x).logits[:, ::5].argmax(-1)
            alone = torch.cat([model(x[:, i:i + 1]).logits for i in range(0, 50, 5)], 1).argmax(-1)
        assert (in_context != alone).float().mean() > 0.5, arch


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


@pytest.mark.gpu
@pytest.mark.parametrize("arch", sorted(SUPPORTED))
def test_supported_architecture_on_cuda(arch, family_dirs, hf_reference, make_llm):
    """The same comparison on a GPU (the device check runs the gpu-marked tests): the Triton
    kernels compiled, fp32, chunked prefill; eager steps, so twenty architectures fit its budget."""
    model = family_dirs(arch)
    llm = make_llm(model, device="cuda", block_size=16, num_gpu_blocks=256, max_num_batched_tokens=32)
    assert llm.engine.runner.backend.name == "triton"
    prompts = mixed_prompts(8, seed=34, lo=5, hi=60)
    assert served(llm, prompts) == [hf_reference(model).greedy(p, MAX_TOKENS) for p in prompts]


# Families whose layers use the attention variants (windows, soft-caps, sinks).
VARIANT_FAMILIES = ["Cohere2ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM",
                    "MistralForCausalLM", "Qwen2ForCausalLM"]


def test_the_compiled_step_serves_variants_and_quantized_linears(family_dirs, hf_reference, make_llm, tmp_path):
    """The tests above run eager steps. Compiled (one compile, the slow part, for both): Gemma 2's
    windows and soft-caps travel as the paged attention op's own arguments through the graph, and
    its int8 linears as the quantized kernel's opaque op. (gpt-oss's sinks, a tensor argument, are
    compiled in tests/test_attention_variants.py: a compiled MoE costs a minute of compile.)"""
    from tests.test_quantization import dequantized_checkpoint
    model = family_dirs("Gemma2ForCausalLM")
    llm = make_llm(model, block_size=8, num_gpu_blocks=256, max_num_batched_tokens=32, enforce_eager=False,
                   quantization="int8")
    reference = hf_reference(dequantized_checkpoint(model, llm.engine.runner.model, tmp_path / "dequantized"))
    prompts = mixed_prompts(8, seed=34, lo=5, hi=60)
    assert served(llm, prompts) == [reference.greedy(p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("arch", VARIANT_FAMILIES)
def test_the_torch_attention_backend_serves_the_variants_exactly(arch, family_dirs, hf_reference, make_llm):
    """The portable backend (the CPU one's C++ kernels are the default above): chunked prefill
    and prefix-cache hits past the windows."""
    model = family_dirs(arch)
    reference = hf_reference(model)
    llm = make_llm(model, block_size=8, num_gpu_blocks=256, max_num_batched_tokens=32, attention_backend="torch")
    first = mixed_prompts(6, seed=36, lo=17, hi=60)
    again = [p[:24] + q for p, q in zip(first, mixed_prompts(6, seed=37, lo=1, hi=20))]
    assert served(llm, first) == [reference.greedy(p, MAX_TOKENS) for p in first]
    assert served(llm, again) == [reference.greedy(p, MAX_TOKENS) for p in again]
    assert llm.engine.stats()["prefix_cache_hit_rate"] > 0


@pytest.mark.parametrize("arch", sorted(SUPPORTED))
def test_supported_architecture_through_the_disaggregated_handoff(arch, family_dirs, hf_reference):
    """Prefill engine -> KV pages over shm -> decode engine, the prefill chunked (24 tokens a
    step, so pages ship over several steps): greedy output equals transformers'."""
    from splitserve.engine import EngineConfig
    from splitserve.worker.wiring import build_decode, build_prefill
    from tests.test_kvtransfer_handoff import handoff

    model = family_dirs(arch)

    def config(**kw):
        return EngineConfig(model=str(model), dtype="float32", enforce_eager=True, block_size=8, num_gpu_blocks=128,
                            **kw)
    decode = build_decode(config(), "shm")
    prefill = build_prefill(config(max_num_batched_tokens=24), verify_checksum=True)
    try:
        prompts = mixed_prompts(5, seed=38, lo=5, hi=60)
        outputs, _ = handoff(prefill, decode, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert [o.token_ids for o in outputs] == [hf_reference(model).greedy(p, 8) for p in prompts]
        prefill.engine.assert_idle()
        decode.engine.assert_idle()
    finally:
        prefill.close()
        decode.close()


def config_only(path, config) -> str:
    """A checkpoint directory with a config and a tokenizer and no weights at all."""
    path.mkdir()
    config.architectures = [config.architectures[0]] if config.architectures else None
    (path / "config.json").write_text(config.to_json_string())
    byte_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("arch, config, missing", [
    ("Gemma3ForConditionalGeneration", transformers.Gemma3Config(), "a vision tower"),
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


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "Gemma2ForCausalLM", "GptOssForCausalLM"])
def test_the_variants_are_in_force_in_these_models(arch, family_dirs, hf_reference):
    """The families' windows (16 tokens), soft-caps and sinks change transformers' own tokens on
    the prompts the tests send: a model served without them could not pass the test above."""
    model = family_dirs(arch)
    prompts = mixed_prompts(8, seed=34, lo=5, hi=60)
    plain = transformers.AutoConfig.from_pretrained(model)
    plain.sliding_window = 4096  # longer than every prompt: no window
    if arch == "Gemma2ForCausalLM":
        plain.attn_logit_softcapping = None
    without = transformers.AutoModelForCausalLM.from_pretrained(model, config=plain, dtype=torch.float32).eval()
    if arch == "GptOssForCausalLM":
        with torch.no_grad():
            for layer in without.model.layers:
                layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) is 0: no sink
    reference = hf_reference(model)
    differ = 0
    for p in prompts:
        with torch.no_grad():
            out = without.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                   eos_token_id=without.config.vocab_size, pad_token_id=0)
        differ += out[0, len(p):].tolist() != reference.greedy(p, MAX_TOKENS)
    assert differ >= 2, f"only {differ} of {len(prompts)} prompts show the variant"


def test_quantized_checkpoints_are_refused_before_any_weight_loads(tmp_path):
    config = transformers.GptOssConfig()
    config.architectures = ["GptOssForCausalLM"]
    config.quantization_config = {"quant_method": "mxfp4"}
    with pytest.raises(UnsupportedModel, match="quantized weights \\(quant_method=mxfp4\\)"):
        LLM(model=config_only(tmp_path / "m", config), dtype="float32", enforce_eager=True)


@pytest.mark.parametrize("arch", ["GraniteForCausalLM", "Gemma2ForCausalLM", "CohereForCausalLM"])
def test_logits_go_through_the_models_own_head(arch, family_dirs, make_llm):
    """Granite divides its logits by logits_scaling after the projection, Cohere multiplies them by
    logit_scale, Gemma 2 soft-caps them:
    greedy choices do not show it, logprobs do. The engine's logprobs equal transformers'."""
    model = family_dirs(arch)
    config = transformers.AutoConfig.from_pretrained(model)
    assert final_logits(config) is not None
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

    config = transformers.MambaConfig()
    config.architectures = ["MambaForCausalLM"]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "splitserve.cli", "decode", "--model",
                             config_only(tmp_path / "m", config)], capture_output=True, text=True, timeout=300,
                            env=env, cwd=root)
    assert result.returncode == 1, result.stderr
    assert "Error: MambaForCausalLM is not supported" in result.stderr and "Traceback" not in result.stderr


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
