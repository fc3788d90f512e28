"""Quantized checkpoints served as shipped (issue 35): GGUF Q4_0 / Q4_1 / Q8_0, through the group-wise
kernel (``linear_wq``), against transformers running the same de-quantized weights.

The GGUF files are written here the way llama.cpp's converter lays them out: tensor names from
``gguf``'s own name map, Llama's q/k rows permuted for llama.cpp's rotary layout, blocks from
``gguf``'s own quantizers. The oracle is the float model with every quantized weight replaced by
``gguf``'s own de-quantization of its blocks: the kernel rebuilds those weights bit for bit, so in
fp32 greedy output must be equal token for token.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from splitserve.engine import EngineConfig, SamplingParams
from splitserve.engine.attention import cpu_kernels
from splitserve.engine.quantization.grouped import (
    GroupQuantizedEmbedding,
    GroupQuantizedLinear,
    dequantize,
    pack_nibbles,
    unpack_nibbles,
)
from tests.harness.model_families import make_family_model
from tests.harness.tiny_models import make_tiny_model
from tests.harness.quantized_checkpoints import (
    pack_awq,
    random_k_blocks,
    pack_gptq,
    write_compressed,
    write_fp8,
    write_gguf,
    write_packed,
)
from tests.test_engine_correctness import mixed_prompts

gguf = pytest.importorskip("gguf")
needs_cpu_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ toolchain")
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


# ------------------------------------------------------------------------------------ the kernel

def grouped_weights(bits: int, n: int, k: int, group: int, offsets: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        codes = pack_nibbles(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8))
    else:
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=g) / 50).half().float()  # 16-bit scales, as the formats ship
    return codes, scales, (torch.randn(n, k // group, generator=g) / 10 if offsets else None)


def test_nibbles_pack_in_ggufs_order():
    codes = torch.arange(64, dtype=torch.uint8).reshape(1, 64) % 16
    packed = pack_nibbles(codes)
    # Byte i of each 32 codes: code i low, code i + 16 high.
    assert packed[0, 0].item() == (0 | (16 % 16) << 4) and packed[0, 3].item() == (3 | (19 % 16) << 4)
    assert torch.equal(unpack_nibbles(packed), codes)


@needs_cpu_kernels
@pytest.mark.parametrize("bits, group, offsets", [(4, 32, True), (4, 128, True), (4, 64, False), (8, 32, False),
                                                  (8, 128, True), (8, 16, False), (4, 16, True)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_kernel_is_the_matmul_over_the_dequantized_weight(bits, group, offsets, rows, dtype):
    # 70 channels (tiles of 4 and a tail of 2, blocks of 64 and a tail of 6) over 256 inputs.
    codes, scales, offs = grouped_weights(bits, 70, 256, group, offsets)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = torch.ops.splitserve_cpu.linear_wq(x, codes, scales, offs, bits, group)
    expected = torch.nn.functional.linear(x.float(), dequantize(codes, scales, offs, bits, group))
    assert out.dtype == dtype and out.shape == (rows, 70)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@needs_cpu_kernels
@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_each_gguf_block_type_is_rebuilt_bit_for_bit(gguf_type):
    """The kernel's weight (one multiply-add of code, scale and offset) is gguf's own de-quantization."""
    from splitserve.engine.quantization.gguf import BLOCK_TYPES, blocks_to_groups
    qtype = gguf.GGMLQuantizationType[gguf_type]
    if gguf_type.endswith("_K"):  # gguf has no quantizer for these: random super-blocks
        blocks = random_k_blocks(48, 512, gguf_type, seed=3)
    else:
        blocks = gguf.quantize(np.random.default_rng(3).normal(0, 0.3, (48, 512)).astype(np.float32), qtype)
    expected = torch.from_numpy(gguf.dequantize(blocks, qtype))
    codes, scales, offsets = blocks_to_groups(blocks, gguf_type)
    bits, group = BLOCK_TYPES[gguf_type]
    assert torch.equal(dequantize(codes, scales, offsets, bits, group), expected)
    # Through the kernel: an identity input reads the weight back, column by column.
    read = torch.ops.splitserve_cpu.linear_wq(torch.eye(512), codes, scales, offsets, bits, group)
    assert torch.equal(read.T, expected)


def test_group_shapes_the_kernel_cannot_take_are_refused():
    codes, scales, _ = grouped_weights(4, 8, 96, 32, False)
    with pytest.raises(ValueError, match="group size 40 is not supported"):
        GroupQuantizedLinear(codes, scales[:, :2], None, bits=4, group_size=40, in_features=96)
    with pytest.raises(ValueError, match="3-bit weights are not supported"):
        GroupQuantizedLinear(codes, scales, None, bits=3, group_size=32, in_features=96)
    with pytest.raises(ValueError, match="scales must be"):
        GroupQuantizedLinear(codes, scales[:, :2], None, bits=4, group_size=32, in_features=96)


def test_a_linear_split_over_ranks_keeps_its_own_groups():
    codes, scales, offsets = grouped_weights(4, 8, 128, 32, True)
    whole = GroupQuantizedLinear(codes, scales, offsets, bits=4, group_size=32, in_features=128,
                                 bias=torch.randn(8))
    weight = whole.dequantized()
    rows = [whole.narrowed(0, r, 2, keep_bias=True) for r in range(2)]
    assert torch.equal(torch.cat([r.dequantized() for r in rows]), weight)
    assert torch.equal(torch.cat([r.bias for r in rows]), whole.bias)
    columns = [whole.narrowed(1, r, 2, keep_bias=False) for r in range(2)]
    assert torch.equal(torch.cat([c.dequantized() for c in columns], dim=1), weight)
    assert all(c.bias is None for c in columns)
    with pytest.raises(ValueError, match="not a whole number of its groups"):
        whole.narrowed(1, 0, 8, keep_bias=False)


# ------------------------------------------------------------------------------- GGUF files


CASES = [
    # Llama: q/k rows permuted in the file, an untied output projection; each block type.
    ("LlamaForCausalLM", "llama", {"embedding": "Q8_0", "linear": "Q4_1"}),
    ("LlamaForCausalLM", "llama", {"embedding": "Q4_0", "linear": "Q8_0"}),
    # Qwen2: biases on q/k/v, a tied output projection read from the Q8_0 embedding's codes.
    ("Qwen2ForCausalLM", "qwen2", {"embedding": "Q8_0", "linear": "Q4_0"}),
]


@needs_cpu_kernels
@pytest.mark.parametrize("family, arch, types", CASES, ids=["llama-q4_1", "llama-q8_0", "qwen2-q4_0-tied"])
def test_a_gguf_is_served_in_its_codes_exactly(family, arch, types, tmp_path, hf_reference, make_llm):
    model = make_family_model(tmp_path / "model", family)
    served, reference_dir = write_gguf(model, tmp_path / "gguf", types, arch)
    llm = make_llm(served, quantization="gguf", block_size=8, num_gpu_blocks=256, max_num_batched_tokens=32)
    runner_model = llm.engine.runner.model
    linears = [m for m in runner_model.modules() if isinstance(m, GroupQuantizedLinear)]
    assert len(linears) == 2 * 7 + 1 and all(m.bits == (4 if types["linear"] != "Q8_0" else 8) for m in linears[:-1])
    assert isinstance(runner_model.get_input_embeddings(), GroupQuantizedEmbedding)
    assert not any(isinstance(m, torch.nn.Linear) for m in runner_model.modules())
    reference = hf_reference(reference_dir)
    first = mixed_prompts(8, seed=34, lo=5, hi=60)
    again = [p[:24] + q for p, q in zip(first, mixed_prompts(8, seed=35, lo=1, hi=20)) if len(p) >= 24]
    assert [o.token_ids for o in llm.generate(first, GREEDY)] == [reference.greedy(p, 10) for p in first]
    assert [o.token_ids for o in llm.generate(again, GREEDY)] == [reference.greedy(p, 10) for p in again]


@needs_cpu_kernels
def test_a_q4_k_m_gguf_is_served_in_its_codes_exactly(tmp_path, hf_reference, make_llm):
    """Q4_K_M's mix, as llama.cpp writes it: Q4_K linears, Q6_K for attn_v, ffn_down and the output."""
    # Rows of whole K-quant super-blocks (256 weights): hidden 256, MLP 512.
    model = make_tiny_model(tmp_path / "model", head_dim=64, intermediate_size=512)
    types = {"embedding": "Q8_0", "linear": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "output.": "Q6_K"}
    served, reference_dir = write_gguf(model, tmp_path / "gguf", types)
    llm = make_llm(served, quantization="gguf", block_size=8, num_gpu_blocks=256, max_num_batched_tokens=32)
    kinds = sorted({m.fmt for m in llm.engine.runner.model.modules() if isinstance(m, GroupQuantizedLinear)})
    assert kinds == ["GGUF Q4_K", "GGUF Q6_K"]
    prompts = mixed_prompts(8, seed=34, lo=5, hi=60)
    reference = hf_reference(reference_dir)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [reference.greedy(p, 10) for p in prompts]


@needs_cpu_kernels
def test_a_gguf_through_the_compiled_step(tmp_path, hf_reference, make_llm):
    model = make_family_model(tmp_path / "model", "LlamaForCausalLM")
    served, reference_dir = write_gguf(model, tmp_path / "gguf", CASES[0][2])
    llm = make_llm(served, quantization="gguf", enforce_eager=False, block_size=8, num_gpu_blocks=128)
    prompts = mixed_prompts(4, seed=36, lo=5, hi=40)
    reference = hf_reference(reference_dir)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [reference.greedy(p, 10) for p in prompts]


@needs_cpu_kernels
def test_a_gguf_through_the_disaggregated_handoff(tmp_path, hf_reference):
    from splitserve.worker.wiring import build_decode, build_prefill
    from tests.test_kvtransfer_handoff import handoff

    model = make_family_model(tmp_path / "model", "LlamaForCausalLM")
    served, reference_dir = write_gguf(model, tmp_path / "gguf", CASES[0][2])

    def config(**kw):
        return EngineConfig(model=str(served), dtype="float32", enforce_eager=True, block_size=8, num_gpu_blocks=128,
                            quantization="gguf", **kw)
    decode = build_decode(config(), "shm")
    prefill = build_prefill(config(max_num_batched_tokens=24), verify_checksum=True)
    try:
        prompts = mixed_prompts(5, seed=38, lo=5, hi=60)
        outputs, _ = handoff(prefill, decode, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        reference = hf_reference(reference_dir)
        assert [o.token_ids for o in outputs] == [reference.greedy(p, 8) for p in prompts]
    finally:
        prefill.close()
        decode.close()


@needs_cpu_kernels
def test_two_tensor_parallel_ranks_split_a_ggufs_codes(tmp_path, hf_reference):
    """Each rank keeps its rows (q/k/v, gate/up) or its whole groups of inputs (o, down) of the codes
    as shipped: the sum over ranks is the same weights' product, so greedy output is unchanged."""
    from splitserve.engine import LLM
    model = make_family_model(tmp_path / "model", "LlamaForCausalLM")
    served, reference_dir = write_gguf(model, tmp_path / "gguf", CASES[0][2])
    two = LLM(model=str(served), dtype="float32", enforce_eager=True, num_gpu_blocks=64, tensor_parallel_size=2,
              quantization="gguf")
    try:
        prompts = mixed_prompts(6, seed=5)
        reference = hf_reference(reference_dir)
        assert [o.token_ids for o in two.generate(prompts, GREEDY)] == [reference.greedy(p, 10) for p in prompts]
    finally:
        two.engine.close()


def test_gguf_types_it_does_not_serve_are_refused_by_name(tmp_path):
    from splitserve.engine.model_loader import load_model
    model = make_family_model(tmp_path / "model", "LlamaForCausalLM")
    served, _ = write_gguf(model, tmp_path / "gguf", {"embedding": "Q8_0", "linear": "Q5_1"})
    with pytest.raises(ValueError, match="is Q5_1; this engine serves GGUF Q4_0, Q4_1, Q8_0, Q4_K, Q6_K"):
        load_model(served, torch.float32, checkpoint_quantization="gguf")


def test_a_model_directory_needs_exactly_one_gguf(tmp_path):
    from splitserve.engine.model_loader import load_model
    model = make_family_model(tmp_path / "model", "LlamaForCausalLM")
    with pytest.raises(ValueError, match=r"needs exactly one \.gguf file .* \(found: none\)"):
        load_model(model, torch.float32, checkpoint_quantization="gguf")


# ------------------------------------------------------------------------------- GPTQ and AWQ


def test_the_packers_lay_words_out_as_the_formats_do():
    """Anchors for the two layouts: a symmetric 4-bit GPTQ (v1) stores zero 8 as 7 in every nibble
    (0x77777777), and AWQ packs channels 0..7 holding 0..7 as 0x75316420."""
    _, qzeros = pack_gptq(torch.zeros(8, 8, dtype=torch.int32), torch.full((1, 8), 8), 4, v1=True)
    assert qzeros.item() == 0x77777777
    assert pack_awq(torch.arange(8).reshape(1, 8)).item() == 0x75316420


PACKED = [
    ("gptq", dict(bits=4, group=32)),
    ("gptq", dict(bits=4, group=32, act_order=True)),
    ("gptq", dict(bits=4, group=64)),
    ("gptq", dict(bits=8, group=32, v1=False)),
    ("awq", dict(bits=4, group=32)),
]


@needs_cpu_kernels
@pytest.mark.parametrize("method, kw", PACKED, ids=["gptq-4bit", "gptq-4bit-act-order", "gptq-4bit-g64", "gptq-8bit-v2", "awq"])
@pytest.mark.parametrize("family", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_a_gptq_or_awq_checkpoint_is_served_exactly(method, kw, family, tmp_path, hf_reference, make_llm):
    model = make_family_model(tmp_path / "model", family)
    served, reference_dir, quantized = write_packed(model, tmp_path / method, method, **kw)
    # No --quantization: the checkpoint's quantization_config says what it is.
    llm = make_llm(served, block_size=8, num_gpu_blocks=256, max_num_batched_tokens=32)
    assert llm.engine.runner.quantization == method
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, GroupQuantizedLinear)]
    assert len(linears) == quantized == 14 and all(m.bits == kw["bits"] for m in linears)
    assert all((m.input_order is not None) == kw.get("act_order", False) for m in linears)
    reference = hf_reference(reference_dir)
    prompts = mixed_prompts(8, seed=34, lo=5, hi=60)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [reference.greedy(p, 10) for p in prompts]


@needs_cpu_kernels
def test_a_gptq_checkpoint_through_the_handoff_and_two_ranks(tmp_path, hf_reference):
    from splitserve.engine import LLM
    from splitserve.worker.wiring import build_decode, build_prefill
    from tests.test_kvtransfer_handoff import handoff

    model = make_family_model(tmp_path / "model", "LlamaForCausalLM")
    served, reference_dir, _ = write_packed(model, tmp_path / "gptq", "gptq", bits=4, group=32)
    reference = hf_reference(reference_dir)
    prompts = mixed_prompts(5, seed=38, lo=5, hi=60)

    def config(**kw):
        return EngineConfig(model=str(served), dtype="float32", enforce_eager=True, block_size=8, num_gpu_blocks=128,
                            **kw)
    decode = build_decode(config(), "shm")
    prefill = build_prefill(config(max_num_batched_tokens=24), verify_checksum=True)
    try:
        outputs, _ = handoff(prefill, decode, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert [o.token_ids for o in outputs] == [reference.greedy(p, 8) for p in prompts]
    finally:
        prefill.close()
        decode.close()
    two = LLM(model=str(served), dtype="float32", enforce_eager=True, num_gpu_blocks=64, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in two.generate(prompts, GREEDY)] == [reference.greedy(p, 10) for p in prompts]
    finally:
        two.engine.close()


def test_quantized_checkpoints_it_cannot_read_are_refused_by_name(tmp_path):
    from splitserve.engine import LLM
    from splitserve.engine.model_registry import UnsupportedModel
    model = make_family_model(tmp_path / "model", "LlamaForCausalLM")
    served, _, _ = write_packed(model, tmp_path / "gptq", "gptq", bits=4, group=32)
    with pytest.raises(UnsupportedModel, match="quantized with gptq; --quantization int8 cannot apply"):
        LLM(model=str(served), dtype="float32", enforce_eager=True, quantization="int8")
    config = json.loads((served / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (served / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match=r"quant_method=bitsandbytes\) is not supported: this engine reads "
                                               "gguf, gptq, awq, fp8, compressed-tensors checkpoints"):
        LLM(model=str(served), dtype="float32", enforce_eager=True)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 3, "group_size": 32}
    (served / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPTQ with 3-bit weights is not supported"):
        LLM(model=str(served), dtype="float32", enforce_eager=True)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 24}
    (served / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="group size 24 is not supported"):
        LLM(model=str(served), dtype="float32", enforce_eager=True)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}
    (served / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="AWQ with bits=4, version='gemv'"):
        LLM(model=str(served), dtype="float32", enforce_eager=True)


# ------------------------------------------------------------------- FP8 and compressed-tensors


COMPRESSED = [
    ("W4A16", "pack-quantized", dict(group_size=32)),
    ("W4A16_ASYM", "pack-quantized", dict(group_size=32)),
    ("W8A16", "pack-quantized", dict(strategy="channel", group_size=None)),
    ("W8A8", "int-quantized", dict()),
    ("FP8", "float-quantized", dict()),
    ("FP8_DYNAMIC", "float-quantized", dict()),
    ("FP8_BLOCK", "float-quantized", dict(block_structure=[16, 32])),
]


@needs_cpu_kernels
@pytest.mark.parametrize("preset, fmt, weights_args", COMPRESSED, ids=[c[0].lower() for c in COMPRESSED])
def test_a_compressed_tensors_checkpoint_is_served_exactly(preset, fmt, weights_args, tmp_path, hf_reference,
                                                           make_llm):
    pytest.importorskip("compressed_tensors")
    model = make_family_model(tmp_path / "model", "Qwen2ForCausalLM")
    served, reference_dir, quantized = write_compressed(model, tmp_path / preset, preset, fmt, **weights_args)
    llm = make_llm(served, block_size=8, num_gpu_blocks=256, max_num_batched_tokens=32)
    assert llm.engine.runner.quantization == "compressed-tensors"
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, GroupQuantizedLinear)]
    assert len(linears) == quantized == 14
    reference = hf_reference(reference_dir)
    prompts = mixed_prompts(8, seed=34, lo=5, hi=60)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [reference.greedy(p, 10) for p in prompts]


@needs_cpu_kernels
@pytest.mark.parametrize("block", [None, [16, 32]], ids=["per-tensor", "blocks"])
def test_an_fp8_checkpoint_is_served_exactly(block, tmp_path, hf_reference, make_llm):
    model = make_family_model(tmp_path / "model", "LlamaForCausalLM")
    served, reference_dir = write_fp8(model, tmp_path / "fp8", block)
    llm = make_llm(served, block_size=8, num_gpu_blocks=256, max_num_batched_tokens=32)
    assert llm.engine.runner.quantization == "fp8" and llm.engine.runner.checkpoint_quantization == "fp8"
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, GroupQuantizedLinear)]
    assert len(linears) == 14 and all(m.codes.dtype == torch.float8_e4m3fn for m in linears)
    reference = hf_reference(reference_dir)
    prompts = mixed_prompts(8, seed=34, lo=5, hi=60)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [reference.greedy(p, 10) for p in prompts]


# ------------------------------------------------------------------------------- the GPU path

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("bits, codes_dtype, offsets, group", [(4, torch.uint8, True, 64), (8, torch.int8, False, 16),
                                                               (8, torch.float8_e4m3fn, False, 64)])
@pytest.mark.parametrize("rows", [3, 20])
def test_the_triton_kernel_is_the_matmul_over_the_dequantized_weight(bits, codes_dtype, offsets, group, rows):
    pytest.importorskip("triton")
    from splitserve.engine.quantization.triton_grouped import grouped_matmul
    codes, scales, offs = grouped_weights(bits, 70, 128, group, offsets)
    if codes_dtype == torch.float8_e4m3fn:
        codes = (codes.float() / 8).to(torch.float8_e4m3fn)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(1))
    expected = torch.nn.functional.linear(x, dequantize(codes, scales, offs, bits, group))
    torch.testing.assert_close(grouped_matmul(x, codes, scales, offs, bits, group), expected, rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())


GPU_FORMATS = ["gguf", "gptq-act-order", "w4a16", "fp8-blocks"]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", GPU_FORMATS)
def test_quantized_checkpoints_on_cuda(fmt, tmp_path, hf_reference, make_llm):
    """Each kind of codes through the compiled Triton kernel on a GPU (the device check runs the
    gpu-marked tests), fp32, against transformers on the weights the codes stand for."""
    model = make_family_model(tmp_path / "model", "LlamaForCausalLM")
    quantization = None
    if fmt == "gguf":
        served, reference_dir = write_gguf(model, tmp_path / fmt, CASES[0][2])
        quantization = "gguf"
    elif fmt == "gptq-act-order":
        served, reference_dir, _ = write_packed(model, tmp_path / fmt, "gptq", bits=4, group=32, act_order=True)
    elif fmt == "w4a16":
        served, reference_dir, _ = write_compressed(model, tmp_path / fmt, "W4A16", "pack-quantized", group_size=32)
    else:
        served, reference_dir = write_fp8(model, tmp_path / fmt, [16, 32])
    llm = make_llm(served, device="cuda", quantization=quantization, block_size=16, num_gpu_blocks=256,
                   max_num_batched_tokens=32)
    assert all(m.codes.is_cuda for m in llm.engine.runner.model.modules() if isinstance(m, GroupQuantizedLinear))
    prompts = mixed_prompts(8, seed=34, lo=5, hi=60)
    reference = hf_reference(reference_dir)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [reference.greedy(p, 10) for p in prompts]


@pytest.mark.gpu
def test_fp8_weights_on_fp8_tensor_cores():
    """On a Hopper-class GPU, per-channel fp8 codes with bf16 activations run torch._scaled_mm (the
    activations quantized per row): close to the de-quantized matmul, not equal to it."""
    from splitserve.engine.quantization.triton_grouped import fp8_rowwise_supported
    if not fp8_rowwise_supported(torch.device("cuda")):
        pytest.skip("fp8 row-wise scaled matmuls need compute capability 9.0")
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(256, 512, generator=g) / 10
    scales = weight.abs().amax(dim=1, keepdim=True) / 448
    codes = (weight / scales).to(torch.float8_e4m3fn)
    layer = GroupQuantizedLinear(codes, scales, None, bits=8, group_size=512, in_features=512).cuda()
    x = torch.randn(33, 512, generator=g).cuda().bfloat16()
    expected = torch.nn.functional.linear(x.float(), layer.dequantized())
    out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=0.1, atol=0.05 * expected.abs().max().item())
