"""splitserve/engine/cpu_linear.py: linear layers on prepacked oneDNN weights (fp32; bf16 where the CPU has it)."""
import pytest
import torch

from splitserve.engine.cpu_linear import (FusedLinears, FusedMember, OnednnLinear, onednn_computes, pack_linear_layers,
                               resolve_linear_backend)
from tests.test_engine_correctness import GREEDY, assert_matches, mixed_prompts

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")

# Both ways of packing a linear: torch's oneDNN inner product, and the matmul primitive of the
# onednn-cpu-gomp wheel (a dependency on x86-64 Linux: its op must build there).
PACKINGS = ["onednn", "onednn-matmul"]


@pytest.mark.parametrize("backend", PACKINGS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (1, 5, 48), (64, 48), (65, 48), (2, 100, 48), (300, 48)])
def test_packed_linear_equals_nn_linear(backend, bias, shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=bias)
    x = torch.randn(shape)
    packed = OnednnLinear(linear, backend)
    assert packed(x).shape == (*shape[:-1], 80)
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()  # each case compiles the same forward afresh (dynamo's recompile limit is 8)
    compiled = torch.compile(packed, fullgraph=True)
    torch.testing.assert_close(compiled(x), linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not onednn_computes(torch.bfloat16), reason="this CPU's oneDNN has no native bf16")
@pytest.mark.parametrize("backend", PACKINGS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 16, 65])
def test_packed_bf16_linear_equals_nn_linear(backend, bias, rows):
    """bf16 weights pack too where the CPU computes bf16 natively; fused groups included."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 64).to(torch.bfloat16)
    packed = OnednnLinear(linear, backend)
    assert packed(x).dtype == torch.bfloat16
    # Both accumulate in fp32 and round once to bf16: they may differ by one bf16 step.
    torch.testing.assert_close(packed(x), linear(x), rtol=1.6e-2, atol=1e-2)
    fused = FusedLinears([linear, linear], backend)
    torch.testing.assert_close(fused.part(1, x), linear(x), rtol=1.6e-2, atol=1e-2)


def test_the_matmul_op_builds_and_checks_its_packed_weight():
    """Where the oneDNN wheel is installed (every x86-64 Linux install) its op builds, and a weight
    packed for another shape is refused, not read past its end."""
    from splitserve.engine.attention import cpu_kernels
    assert cpu_kernels.onednn_root() is not None
    assert cpu_kernels.matmul_available(), cpu_kernels.matmul_error()
    small = OnednnLinear(torch.nn.Linear(16, 8), "onednn-matmul")
    with pytest.raises(RuntimeError, match="not packed for this shape"):
        torch.ops.splitserve_dnnl.linear(torch.randn(3, 48), small.packed_weight, None, 48, 80, 32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        torch.ops.splitserve_dnnl.pack(torch.randn(8, 16, dtype=torch.float64), 32)


@pytest.mark.parametrize("rows", [1, 8, 64, 65, 129, 300])
def test_the_cpp_linear_op_equals_the_python_one(rows):
    """The C++ op (the one packed linears call where the CPU kernels built) pads, runs and cuts
    exactly as the Python definition does: bit-identical outputs, same shapes."""
    from splitserve.engine.attention import cpu_kernels
    from splitserve.engine.cpu_linear import linear_op
    assert cpu_kernels.available(), cpu_kernels.load_error()
    assert linear_op() is torch.ops.splitserve_cpu.onednn_linear
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80)
    packed = OnednnLinear(linear)
    x = torch.randn(2, rows, 48)
    cpp = torch.ops.splitserve_cpu.onednn_linear(x, packed.packed_weight, packed.bias, 80)
    python = torch.ops.splitserve.onednn_linear(x, packed.packed_weight, packed.bias, 80)
    assert cpp.shape == python.shape == (2, rows, 80)
    assert torch.equal(cpp, python)


def test_the_cpp_op_pads_to_the_row_counts_the_runner_feeds():
    """The C++ op pads to ``padded_rows`` as Python computes it: the count the runner pads whole
    steps to (step_inputs.InputBuffers.pad_tokens). Were the two to differ, every linear of a
    padded step would copy its input again."""
    from torch.profiler import profile

    from splitserve.engine.cpu_linear import padded_rows
    linear = OnednnLinear(torch.nn.Linear(48, 80))
    counts = (1, 64, 65, 100, 129, 250, 300, 1000, 2047)
    with profile(record_shapes=True) as prof:
        for rows in counts:
            torch.ops.splitserve_cpu.onednn_linear(torch.randn(rows, 48), linear.packed_weight, linear.bias, 80)
    ran = [event.input_shapes[0][0] for event in prof.events() if event.name == "mkldnn::_linear_pointwise"]
    assert ran == [padded_rows(rows) for rows in counts]


def test_row_counts_are_rounded_to_a_bounded_set_of_shapes():
    """oneDNN keeps a compiled kernel per shape: above 64 rows they round up (< 12.5 % padding),
    so 2,048 row counts give 104 shapes, not 2,048."""
    from splitserve.engine.cpu_linear import padded_rows
    shapes = {padded_rows(r) for r in range(1, 2049)}
    assert len(shapes) == 64 + 40
    assert all(r <= padded_rows(r) < r * 1.125 or r <= 64 and padded_rows(r) == r for r in range(1, 2049))
    assert [padded_rows(r) for r in (64, 65, 128, 129, 2048)] == [64, 72, 128, 144, 2048]


def test_pack_replaces_every_linear_and_keeps_tied_weights():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 10, bias=False))
    model[2].weight = model[0].weight  # tied, as an lm_head is to the embedding
    ids = torch.tensor([1, 2, 3])
    with torch.no_grad():
        expected = model(ids)
    assert pack_linear_layers(model) == 2
    assert [type(m) for m in model] == [torch.nn.Embedding, OnednnLinear, OnednnLinear]
    assert model[0].weight.shape == (10, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5)


class _Attention(torch.nn.Module):
    """q/k/v (Qwen2-style biases) and an MLP's gate/up, named as `transformers` names them."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(16, n, bias=True) for n in (16, 8, 8))
        self.gate_proj, self.up_proj = (torch.nn.Linear(16, 24, bias=False) for _ in range(2))
        self.o_proj = torch.nn.Linear(16, 16, bias=False)

    def forward(self, x, order=("q", "k", "v")):
        parts = {name: getattr(self, f"{name}_proj")(x) for name in order}
        gate_up = self.gate_proj(x) * self.up_proj(x)
        return torch.cat([parts["q"], parts["k"], parts["v"], gate_up, self.o_proj(x)], dim=-1)


@pytest.mark.parametrize("backend", PACKINGS)
@pytest.mark.parametrize("order", [("q", "k", "v"), ("v", "q", "k")])
def test_fused_groups_equal_their_separate_linears(order, backend):
    """q/k/v and gate/up become one GEMM each, whatever order the members are called in; a fresh
    input is never served from the last one's result; nothing is held between calls."""
    torch.manual_seed(0)
    module = _Attention()
    x, y = torch.randn(5, 16), torch.randn(3, 16)
    with torch.no_grad():
        expected_x, expected_y = module(x, order), module(y, order)
        assert pack_linear_layers(module, backend) == 6
        assert type(module.q_proj) is FusedMember and type(module.o_proj) is OnednnLinear
        assert sorted(n for n, m in module.named_children() if isinstance(m, FusedLinears)) == ["fused_gate_up",
                                                                                               "fused_q_k_v"]
        torch.testing.assert_close(module(x, order), expected_x, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(module(y, order), expected_y, rtol=1e-5, atol=1e-5)
        assert module.fused_q_k_v._input is None and module.fused_gate_up._parts == ()
        module.q_proj(x)  # a call that never finished (only one member ran) ...
        torch.testing.assert_close(module(y, order), expected_y, rtol=1e-5, atol=1e-5)  # ... is not reused
        torch._dynamo.reset()
        compiled = torch.compile(module, fullgraph=True)
        torch.testing.assert_close(compiled(x, order), expected_x, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiled(y, order), expected_y, rtol=1e-5, atol=1e-5)


def test_backend_resolution(monkeypatch):
    from splitserve.engine.attention import cpu_kernels
    cpu, fp32 = torch.device("cpu"), torch.float32
    assert resolve_linear_backend("auto", cpu, fp32) == "onednn-matmul"
    native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # AVX-512 BF16 or AMX
    assert onednn_computes(torch.bfloat16) == native_bf16
    assert resolve_linear_backend("auto", cpu, torch.bfloat16) == ("onednn-matmul" if native_bf16 else "torch")
    native_fp16 = onednn_computes(torch.float16)  # not a dtype of the matmul's
    assert resolve_linear_backend("auto", cpu, torch.float16) == ("onednn" if native_fp16 else "torch")
    assert resolve_linear_backend("torch", cpu, fp32) == "torch"
    assert resolve_linear_backend("onednn", cpu, fp32) == "onednn"
    with pytest.raises(ValueError, match="computes float32 or bfloat16"):
        resolve_linear_backend("onednn-matmul", cpu, torch.float16)
    monkeypatch.setattr(cpu_kernels, "matmul_available", lambda: False)  # no oneDNN wheel: the inner product
    assert resolve_linear_backend("auto", cpu, fp32) == "onednn"
    with pytest.raises(ValueError, match="needs a CPU device and a dtype its oneDNN computes natively"):
        resolve_linear_backend("onednn", cpu, torch.float64)
    with pytest.raises(ValueError, match="needs a CPU device"):
        resolve_linear_backend("onednn", torch.device("meta"), fp32)
    with pytest.raises(ValueError, match="must be one of"):
        resolve_linear_backend("mkl", cpu, fp32)


@pytest.mark.parametrize("linear_backend", ["torch", "onednn", "onednn-matmul"])
def test_engine_matches_transformers_with_each_linear(linear_backend, tiny_model_dirs, make_llm, hf_reference):
    model = tiny_model_dirs["llama"]
    prompts = mixed_prompts(8, seed=11)
    llm = make_llm(model, linear_backend=linear_backend, num_gpu_blocks=128, enforce_eager=False)
    assert llm.engine.runner.linear_backend == linear_backend
    packed = [m.op.name for m in llm.engine.runner.model.modules() if isinstance(m, (OnednnLinear, FusedLinears))]
    assert set(packed) == (set() if linear_backend == "torch" else {linear_backend})
    assert_matches(llm.generate(prompts, GREEDY), prompts, hf_reference(model))


def test_the_runner_projects_logits_with_the_packed_head(tiny_model_dirs, make_llm):
    """The runner keeps the model's output projection to compute logits; it must be the packed one
    that replaced the plain linear (taken before the packing, it computed with the plain one: ~10 %
    slower decode steps on SmolLM2, where the projection is the largest matmul of the step)."""
    llm = make_llm(tiny_model_dirs["llama"], num_gpu_blocks=16, linear_backend="onednn")
    runner = llm.engine.runner
    assert isinstance(runner.model.get_output_embeddings(), OnednnLinear)
    assert runner.lm_head is runner.model.get_output_embeddings()
