"""Mixture-of-experts layers as Triton grouped-GEMM launches (issue 34, point 2: a fused MoE
kernel in Triton on CUDA). On CPU the kernel runs under the Triton interpreter
(``TRITON_INTERPRET=1``, set here before triton is imported unless the environment says
otherwise); on a GPU the same tests run it compiled.

Checked: the device-side tile schedule; the grouped GEMM against a per-expert matmul in both
weight layouts, with and without bias and row gather, experts with no rows; every MoE family's
experts module against ``transformers``' own grouped-matmul implementation (and compiled, gpt-oss's);
and the engine on the Triton backend serving two families exactly against ``transformers``."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from splitserve.engine.attention.triton_common import TRITON_AVAILABLE  # noqa: E402
from splitserve.engine.experts import IMPLEMENTATION, triton_experts_forward  # noqa: E402
from splitserve.engine.experts.triton_gemm import BLOCK_M, tile_schedule  # noqa: E402

RUNS = TRITON_AVAILABLE and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
pytestmark = pytest.mark.skipif(not RUNS, reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MOE_FAMILIES = ["Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM", "Qwen2MoeForCausalLM",
                "OlmoeForCausalLM"]


def test_tile_schedule_covers_each_experts_rows_once():
    counts = torch.tensor([0, 35, 1, 0, 16, 3])
    expert, start, end = tile_schedule(counts, int(counts.sum()))
    rows_start = torch.cumsum(counts, 0) - counts
    covered = {e: [] for e in range(len(counts))}
    for e, s, t in zip(expert.tolist(), start.tolist(), end.tolist()):
        if e == len(counts):
            continue  # an unused tile
        assert t == rows_start[e] + counts[e]  # a tile never reads into the next expert's rows
        covered[e].extend(range(s, min(s + BLOCK_M, t)))
    for e, n in enumerate(counts.tolist()):
        assert covered[e] == list(range(rows_start[e], rows_start[e] + n))
    assert len(expert) == -(-55 // BLOCK_M) + 6  # fixed: rows / BLOCK_M + experts, whatever the counts


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_a_matmul_per_expert(transposed, bias, dtype):
    g = torch.Generator().manual_seed(0)
    num_experts, k_dim, n_dim, tokens, top_k = 5, 48, 40, 23, 2
    x = torch.randn(tokens, k_dim, generator=g).to(dtype)
    w = torch.randn(num_experts, n_dim, k_dim, generator=g).to(dtype)
    b = torch.randn(num_experts, n_dim, generator=g).to(dtype) if bias else None
    ids = torch.stack([torch.randperm(num_experts - 1, generator=g)[:top_k] for _ in range(tokens)]).reshape(-1)
    sorted_ids, order = torch.sort(ids, stable=True)  # expert 4 gets no rows
    counts = torch.bincount(sorted_ids, minlength=num_experts)
    tiles = tile_schedule(counts.to(DEVICE), len(ids))
    weight = w.transpose(1, 2).contiguous() if transposed else w
    out = torch.ops.splitserve.moe_grouped_gemm(x.to(DEVICE), (order // top_k).to(torch.int32).to(DEVICE),
                                                weight.to(DEVICE), None if b is None else b.to(DEVICE), *tiles,
                                                len(ids), transposed).cpu()
    for i, (e, row) in enumerate(zip(sorted_ids.tolist(), (order // top_k).tolist())):
        want = x[row].float() @ w[e].float().T + (b[e].float() if bias else 0)
        tol = 1e-4 if dtype == torch.float32 else 0.05 * want.abs().max().item()
        assert torch.allclose(out[i].float(), want, atol=tol, rtol=0), i


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from tests.harness.model_families import make_family_model
    root = tmp_path_factory.mktemp("moe")
    return {arch: make_family_model(root / arch, arch) for arch in MOE_FAMILIES}


@pytest.mark.parametrize("arch", MOE_FAMILIES)
def test_each_families_experts_equal_transformers_grouped_mm(arch, moe_dirs):
    import transformers
    from transformers.integrations.moe import grouped_mm_experts_forward
    model = transformers.AutoModelForCausalLM.from_pretrained(moe_dirs[arch], dtype=torch.float32)
    experts = next(m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj")).to(DEVICE)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for tokens in (1, 5, 37):
            x = torch.randn(tokens, model.config.hidden_size, generator=g).to(DEVICE)
            top_k = 2
            idx = torch.stack([torch.randperm(experts.num_experts, generator=g)[:top_k]
                               for _ in range(tokens)]).to(DEVICE)
            weights = torch.rand(tokens, top_k, generator=g).to(DEVICE)
            want = grouped_mm_experts_forward(experts, x, idx, weights)
            got = triton_experts_forward(experts, x, idx, weights)
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (arch, tokens)


# Through the engine: a plain SwiGLU family and gpt-oss (biases, transposed weights, its own gate);
# every family's experts module is checked against transformers above.
@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "GptOssForCausalLM"])
def test_the_engine_on_triton_serves_moe_families_exactly(arch, moe_dirs, make_llm, hf_reference):
    from splitserve.engine import SamplingParams
    from tests.test_engine_correctness import mixed_prompts
    model = moe_dirs[arch]
    llm = make_llm(model, device=DEVICE, block_size=8, num_gpu_blocks=64, attention_backend="triton",
                   max_num_batched_tokens=16)  # chunked prefill and decodes in mixed steps
    experts = [m for m in llm.engine.runner.model.modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj")]
    assert experts and all(m.config._experts_implementation == IMPLEMENTATION for m in experts)
    prompts = mixed_prompts(3, seed=36, lo=3, hi=24)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == \
        [hf_reference(model).greedy(p, 4) for p in prompts]


def test_the_experts_compile_into_one_graph(moe_dirs):
    """Under torch.compile (fullgraph, the token count dynamic) the tile schedule traces and each
    projection stays one opaque launch: the same results for two batch sizes from one graph."""
    import transformers
    from transformers.integrations.moe import grouped_mm_experts_forward
    model = transformers.AutoModelForCausalLM.from_pretrained(moe_dirs["GptOssForCausalLM"], dtype=torch.float32)
    experts = next(m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj")).to(DEVICE)
    compiled = torch.compile(lambda x, idx, w: triton_experts_forward(experts, x, idx, w), fullgraph=True,
                             dynamic=True)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for tokens in (3, 19):
            x = torch.randn(tokens, model.config.hidden_size, generator=g).to(DEVICE)
            idx = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(tokens)]).to(DEVICE)
            weights = torch.rand(tokens, 2, generator=g).to(DEVICE)
            assert torch.allclose(compiled(x, idx, weights), grouped_mm_experts_forward(experts, x, idx, weights),
                                  atol=1e-5, rtol=1e-5)
