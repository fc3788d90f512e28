"""Quantized weights (``--quantization int8``; issue 35): the CPU kernel against the matmul it
stands for, and the engine against transformers running the same de-quantized weights.

int8 weight-only quantization changes the model: the oracle is transformers with each quantized
linear's weight replaced by what its codes and scale stand for (``Int8Linear.dequantized``),
saved as a checkpoint of its own. In fp32 the kernel's arithmetic is a float GEMM's over those
weights (up to the order of the additions), so greedy output must be equal token for token.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from splitserve.engine import EngineConfig, SamplingParams
from splitserve.engine.attention import cpu_kernels
from splitserve.engine.model_registry import SUPPORTED
from splitserve.engine.quantization import Int8Linear, int8_matmul, quantize_model
from tests.harness.model_families import make_family_model
from tests.test_engine_correctness import mixed_prompts

needs_cpu_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ toolchain")
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def codes_and_scales(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g) / 50


@needs_cpu_kernels
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 64, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernel_is_the_matmul_over_the_dequantized_weight(rows, dtype):
    # 70 channels (tiles of 4 and a tail of 2, blocks of 64 and a tail of 6) over 72 inputs (16-wide
    # vectors and a tail of 8).
    codes, scales = codes_and_scales(70, 72)
    x = torch.randn(rows, 72, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = torch.ops.splitserve_cpu.int8_linear(x, codes, scales)
    expected = torch.nn.functional.linear(x.float(), codes.float() * scales[:, None])
    assert out.dtype == dtype and out.shape == (rows, 70)
    # float32: one rounding per product and sum; bf16: the output's rounding (and, past 16 rows, the
    # de-quantized weight's).
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())
    # The portable path (CUDA, or no kernels) computes the same.
    torch.testing.assert_close(int8_matmul(x.float(), codes, scales), expected, rtol=1e-5, atol=1e-5)


def test_a_linear_keeps_a_quarter_of_its_fp32_bytes():
    linear = torch.nn.Linear(256, 128, bias=True)
    model = torch.nn.Sequential(linear)
    weight = linear.weight.detach().clone()
    done = quantize_model(model, "int8")
    quantized = model[0]
    assert isinstance(quantized, Int8Linear) and quantized.codes.dtype == torch.int8
    assert done.layers == 1 and done.bytes_before == 128 * 256 * 4 and done.bytes_after == 128 * 256 + 128 * 4
    # Each channel's codes span the int8 range at its largest |w|, and stand for w within half a step.
    assert (quantized.codes.abs().amax(dim=1) == 127).all()
    assert ((quantized.dequantized() - weight).abs() <= quantized.scales[:, None] / 2 + 1e-7).all()


def dequantized_checkpoint(model_dir, quantized_model, out_dir):
    """model_dir's checkpoint with every quantized linear's weight replaced by what it stands for.
    A tied output projection is untied first: the engine's embedding keeps the float table."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    head = reference.get_output_embeddings()
    if head.weight is reference.get_input_embeddings().weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        reference.config.tie_word_embeddings = False
    with torch.no_grad():
        for name, module in quantized_model.named_modules():
            if isinstance(module, Int8Linear):
                reference.get_submodule(name).weight.copy_(module.dequantized())
    reference.save_pretrained(out_dir)
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return out_dir


# Every architecture served (MoE experts stay float: only nn.Linear layers are quantized).
@needs_cpu_kernels
@pytest.mark.parametrize("arch", sorted(SUPPORTED))
def test_the_engine_matches_transformers_on_the_dequantized_weights(arch, tmp_path, hf_reference, make_llm):
    model = make_family_model(tmp_path / "model", arch)
    llm = make_llm(model, quantization="int8", block_size=8, num_gpu_blocks=256, max_num_batched_tokens=32)
    quantized = llm.engine.runner.quantized_weights
    assert quantized is not None and quantized.bytes_after * 3.5 < quantized.bytes_before
    reference = hf_reference(dequantized_checkpoint(model, llm.engine.runner.model, tmp_path / "dequantized"))
    first = mixed_prompts(8, seed=34, lo=5, hi=60)
    again = [p[:24] + q for p, q in zip(first, mixed_prompts(8, seed=35, lo=1, hi=20)) if len(p) >= 24]
    assert [o.token_ids for o in llm.generate(first, GREEDY)] == [reference.greedy(p, 10) for p in first]
    assert [o.token_ids for o in llm.generate(again, GREEDY)] == [reference.greedy(p, 10) for p in again]


@needs_cpu_kernels
def test_int8_weights_through_the_disaggregated_handoff(tmp_path, hf_reference):
    from splitserve.worker.wiring import build_decode, build_prefill
    from tests.test_kvtransfer_handoff import handoff

    model = make_family_model(tmp_path / "model", "LlamaForCausalLM")

    def config(**kw):
        return EngineConfig(model=str(model), dtype="float32", enforce_eager=True, block_size=8, num_gpu_blocks=128,
                            quantization="int8", **kw)
    decode = build_decode(config(), "shm")
    prefill = build_prefill(config(max_num_batched_tokens=24), verify_checksum=True)
    try:
        reference = hf_reference(dequantized_checkpoint(model, prefill.engine.runner.model, tmp_path / "dequantized"))
        prompts = mixed_prompts(5, seed=38, lo=5, hi=60)
        outputs, _ = handoff(prefill, decode, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert [o.token_ids for o in outputs] == [reference.greedy(p, 8) for p in prompts]
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("method, message", [
    ("awq", "quantization='awq' is not implemented by this engine yet"),
    ("fp8", "quantization='fp8' is not implemented by this engine yet"),
    ("int3", "quantization must be one of"),
])
def test_methods_it_does_not_serve_are_refused_by_name(method, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", quantization=method)


def test_the_cli_takes_the_flag():
    from click.testing import CliRunner

    from splitserve.cli.commands import build
    result = CliRunner().invoke(build(), ["decode", "--help"])
    assert result.exit_code == 0 and "--quantization" in result.output


def as_two_ranks_quantize(model_dir, out_dir):
    """model_dir's weights as two ranks hold them quantized: a row-parallel linear's two halves of
    its inputs each with scales of their own (a column-parallel one's rows keep theirs)."""
    import re
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    plan = reference.config.base_model_tp_plan
    rules = [(re.compile(p.replace(".", r"\.").replace("*", r"\d+")), style) for p, style in plan.items()]
    head = reference.get_output_embeddings()
    if head.weight is reference.get_input_embeddings().weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        reference.config.tie_word_embeddings = False
    with torch.no_grad():
        for name, module in list(reference.named_modules()):
            if type(module) is not torch.nn.Linear:
                continue
            inner = name.removeprefix("model.")
            rowwise = any(regex.fullmatch(inner) and style == "rowwise" for regex, style in rules)
            parts = module.weight.chunk(2, dim=1) if rowwise else (module.weight,)
            pieces = []
            for part in parts:
                piece = torch.nn.Linear(part.shape[1], part.shape[0], bias=False)
                piece.weight.copy_(part)
                pieces.append(Int8Linear(piece).dequantized())
            module.weight.copy_(torch.cat(pieces, dim=1))
    reference.save_pretrained(out_dir)
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return out_dir


@needs_cpu_kernels
def test_two_tensor_parallel_ranks_each_quantize_their_own_shard(tiny_model_dirs, tmp_path, hf_reference):
    from splitserve.engine import LLM
    model = tiny_model_dirs["llama"]
    two = LLM(model=str(model), dtype="float32", enforce_eager=True, num_gpu_blocks=64, tensor_parallel_size=2,
              quantization="int8")
    try:
        prompts = mixed_prompts(6, seed=5)
        reference = hf_reference(as_two_ranks_quantize(model, tmp_path / "as-two-ranks"))
        assert [o.token_ids for o in two.generate(prompts, GREEDY)] == [reference.greedy(p, 10) for p in prompts]
    finally:
        two.engine.close()
