"""Quantized weights (``--quantization int8 | fp8``; issue 35): the CPU kernel against the matmul
it stands for, and the engine against transformers running the same de-quantized weights.

Weight-only quantization changes the model: the oracle is transformers with each quantized
linear's weight replaced by what its codes and scale stand for (``QuantizedLinear.dequantized``),
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
from splitserve.engine.quantization import CODE_FORMATS, QuantizedLinear, quantize_model, w8_matmul
from tests.harness.model_families import make_family_model
from tests.test_engine_correctness import mixed_prompts

needs_cpu_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ toolchain")
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


METHODS = sorted(CODE_FORMATS)


def codes_and_scales(method: str, n: int, k: int, seed: int = 0):
    """Codes covering the format's range (every fp8 bit pattern but NaN), and scales."""
    g = torch.Generator().manual_seed(seed)
    if method == "int8":
        codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    else:
        bits = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int32)
        bits[(bits & 0x7F) == 0x7F] = 0  # e4m3fn's NaNs
        codes = bits.to(torch.uint8).view(torch.float8_e4m3fn)
    return codes, torch.rand(n, generator=g) / 50


@needs_cpu_kernels
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 64, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernel_is_the_matmul_over_the_dequantized_weight(method, rows, dtype):
    # 70 channels (tiles of 4 and a tail of 2, blocks of 64 and a tail of 6) over 72 inputs (16-wide
    # vectors and a tail of 8).
    codes, scales = codes_and_scales(method, 70, 72)
    x = torch.randn(rows, 72, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = torch.ops.splitserve_cpu.linear_w8(x, codes, scales)
    expected = torch.nn.functional.linear(x.float(), codes.float() * scales[:, None])
    assert out.dtype == dtype and out.shape == (rows, 70)
    # float32: one rounding per product and sum; bf16: the output's rounding (and, past 16 rows, the
    # de-quantized weight's).
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())
    # The portable path (CUDA, or no kernels) computes the same.
    torch.testing.assert_close(w8_matmul(x.float(), codes, scales), expected, rtol=1e-5, atol=1e-5)


@needs_cpu_kernels
def test_every_fp8_code_is_widened_exactly():
    """The kernel widens e4m3 codes by moving their bits (subnormals fixed apart): each of the 254
    finite codes (and -0) must come out as torch's own conversion of it."""
    bits = torch.arange(256, dtype=torch.int32)
    bits[(bits & 0x7F) == 0x7F] = 0  # the two NaNs
    codes = bits.to(torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16)
    out = torch.ops.splitserve_cpu.linear_w8(torch.eye(16), codes, torch.ones(16))
    assert torch.equal(out, codes.float().T)


@pytest.mark.parametrize("method", METHODS)
def test_a_linear_keeps_a_quarter_of_its_fp32_bytes(method):
    linear = torch.nn.Linear(256, 128, bias=True)
    model = torch.nn.Sequential(linear)
    weight = linear.weight.detach().clone()
    done = quantize_model(model, method)
    quantized = model[0]
    code_dtype, qmax = CODE_FORMATS[method]
    assert isinstance(quantized, QuantizedLinear) and quantized.codes.dtype == code_dtype
    assert done.layers == 1 and done.bytes_before == 128 * 256 * 4 and done.bytes_after == 128 * 256 + 128 * 4
    # Each channel's codes reach the format's largest value at its largest |w|, and stand for w
    # within half a step (int8: half a scale; e4m3: 2^-4 of the value, or half its smallest
    # subnormal step).
    assert (quantized.codes.float().abs().amax(dim=1) == qmax).all()
    error = (quantized.dequantized() - weight).abs()
    if method == "int8":
        assert (error <= quantized.scales[:, None] / 2 + 1e-7).all()
    else:
        assert (error <= weight.abs() * 2.0 ** -4 + quantized.scales[:, None] * 2.0 ** -10 + 1e-7).all()


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
            if isinstance(module, QuantizedLinear):
                reference.get_submodule(name).weight.copy_(module.dequantized())
    reference.save_pretrained(out_dir)
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return out_dir


# Every architecture served (MoE experts stay float: only nn.Linear layers are quantized).
@needs_cpu_kernels
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", sorted(SUPPORTED))
def test_the_engine_matches_transformers_on_the_dequantized_weights(arch, method, tmp_path, hf_reference, make_llm):
    model = make_family_model(tmp_path / "model", arch)
    llm = make_llm(model, quantization=method, block_size=8, num_gpu_blocks=256, max_num_batched_tokens=32)
    quantized = llm.engine.runner.quantized_weights
    assert quantized is not None and quantized.bytes_after * 3.5 < quantized.bytes_before
    # fp8 leaves the output projection float (as vLLM does); int8 quantizes it as well.
    head = llm.engine.runner.model.get_output_embeddings()
    assert isinstance(head, QuantizedLinear) == (method == "int8"), type(head)
    reference = hf_reference(dequantized_checkpoint(model, llm.engine.runner.model, tmp_path / "dequantized"))
    first = mixed_prompts(8, seed=34, lo=5, hi=60)
    again = [p[:24] + q for p, q in zip(first, mixed_prompts(8, seed=35, lo=1, hi=20)) if len(p) >= 24]
    assert [o.token_ids for o in llm.generate(first, GREEDY)] == [reference.greedy(p, 10) for p in first]
    assert [o.token_ids for o in llm.generate(again, GREEDY)] == [reference.greedy(p, 10) for p in again]


@needs_cpu_kernels
@pytest.mark.parametrize("method", METHODS)
def test_quantized_weights_through_the_disaggregated_handoff(method, tmp_path, hf_reference):
    from splitserve.worker.wiring import build_decode, build_prefill
    from tests.test_kvtransfer_handoff import handoff

    model = make_family_model(tmp_path / "model", "LlamaForCausalLM")

    def config(**kw):
        return EngineConfig(model=str(model), dtype="float32", enforce_eager=True, block_size=8, num_gpu_blocks=128,
                            quantization=method, **kw)
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
    ("bitsandbytes", "quantization='bitsandbytes' is not implemented by this engine yet"),
    ("gptq_marlin", "quantization='gptq_marlin' is not implemented by this engine yet"),
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
                pieces.append(QuantizedLinear(piece).dequantized())
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


@needs_cpu_kernels
def test_a_float_checkpoint_is_quantized_as_it_is_read(tmp_path, monkeypatch):
    """One rank quantizes each linear as its weight is read: the whole-model float load is never
    called (it would hold every float weight at once). MoE checkpoints whose per-expert tensors
    transformers converts on load take that whole load instead, then quantize."""
    from splitserve.engine import LLM, model_runner
    calls = []
    real = model_runner.load_model
    monkeypatch.setattr(model_runner, "load_model", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    dense = make_family_model(tmp_path / "llama", "LlamaForCausalLM")
    llm = LLM(model=str(dense), dtype="float32", enforce_eager=True, num_gpu_blocks=64, quantization="int8")
    assert calls == [] and llm.engine.runner.quantized_weights.layers == 2 * 7 + 1
    assert not any(type(m) is torch.nn.Linear for m in llm.engine.runner.model.modules())
    llm.engine.close()
    moe = make_family_model(tmp_path / "mixtral", "MixtralForCausalLM")
    llm = LLM(model=str(moe), dtype="float32", enforce_eager=True, num_gpu_blocks=64, quantization="int8")
    assert len(calls) == 1 and llm.engine.runner.quantized_weights.layers > 0
    llm.engine.close()
