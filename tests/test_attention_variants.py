"""Attention variants in every backend (issue 34, point 1): sliding windows, soft-capped scores and
attention sinks, as `transformers` hands them to the attention function of Mistral, Gemma 2/3 and
gpt-oss.

The plain reference (``attention/reference.py``) is checked against a dense computation written
out here from the definitions; the CPU kernels (decode and prefill, float32 and bf16 pages), the
torch and CPU backends (float and quantized pages) and the Triton kernels (interpreted on CPU,
whole and split-context decode) are checked against the reference. Unused cache slots hold NaN
(``Batch``), so reading outside a sequence's context poisons the output; windows are shorter
than the contexts, so a kernel that ignored one would differ.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from splitserve.engine.attention import cpu_kernels, reference  # noqa: E402
from splitserve.engine.attention.backend import AttentionVariant  # noqa: E402
from splitserve.engine.attention.kv_quant import kv_quant, quantize  # noqa: E402
from splitserve.engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from tests.test_attention_kernels import SCENARIOS, Batch  # noqa: E402
from tests.test_cpu_attention import LONG_DECODE, make_batch  # noqa: E402

# name -> (window, softcap, whether there are sinks). Windows of 5 (inside a page), 23 and 40
# (across pages); a softcap of 2 bends scores of unit size noticeably.
VARIANTS = {
    "window5": (5, 0.0, False),
    "window40": (40, 0.0, False),
    "softcap": (0, 2.0, False),
    "sinks": (0, 0.0, True),
    "window23-softcap-sinks": (23, 3.0, True),
}


def variant_args(name: str, num_q_heads: int, seed: int = 7) -> dict:
    window, softcap, with_sinks = VARIANTS[name]
    sinks = torch.randn(num_q_heads, generator=torch.Generator().manual_seed(seed)) * 2 if with_sinks else None
    return {"window": window, "softcap": softcap, "sinks": sinks}


def dense_variant_attention(batch: Batch, window: int, softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """Each new token over its sequence's un-paged K/V, straight from the definitions: the scaled
    score, tanh soft-capping, a window of positions p - window + 1 .. p, and the sink's exp in the
    denominator of the softmax."""
    outs = []
    qsl = batch.query_start_loc.tolist()
    for b, ctx in enumerate(batch.seq_lens_list):
        k, v = batch.dense_k[b].float(), batch.dense_v[b].float()
        group = batch.query.shape[1] // k.shape[1]
        for i in range(batch.q_lens[b]):
            p = ctx - batch.q_lens[b] + i
            lo = max(0, p - window + 1) if window else 0
            q = batch.query[qsl[b] + i].float()  # [Hq, D]
            kk = k[lo:p + 1].repeat_interleave(group, dim=1)  # [n, Hq, D]
            vv = v[lo:p + 1].repeat_interleave(group, dim=1)
            s = torch.einsum("hd,nhd->hn", q, kk) * batch.scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            m = s.max(dim=1, keepdim=True).values
            if sinks is not None:
                m = torch.maximum(m, sinks[:, None])
            e = torch.exp(s - m)
            denominator = e.sum(dim=1, keepdim=True)
            if sinks is not None:
                denominator = denominator + torch.exp(sinks[:, None] - m)
            outs.append(torch.einsum("hn,nhd->hd", e / denominator, vv))
    return torch.stack(outs)


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("scenario", ["decode", "mixed", "chunked"])
def test_reference_matches_the_definitions(name, scenario):
    batch = Batch(SCENARIOS[scenario] + [(40, 9)], 8, 6, 2, 32, torch.float32, "cpu", fragmented=True)
    args = variant_args(name, 6)
    out = reference.paged_attention(*batch.attention_args(), **args)
    torch.testing.assert_close(out, dense_variant_attention(batch, **args), atol=1e-5, rtol=1e-5)


def test_a_variant_changes_the_output():
    # Each variant must matter on these batches, or the tests above could not see it ignored.
    batch = Batch(LONG_DECODE, 16, 6, 2, 64, torch.float32, "cpu", fragmented=True)
    plain = reference.paged_attention(*batch.attention_args())
    for name in VARIANTS:
        out = reference.paged_attention(*batch.attention_args(), **variant_args(name, 6))
        assert (out - plain).abs().max() > 1e-2, name


needs_cpu_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ toolchain")


@needs_cpu_kernels
@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.bfloat16, 64), (torch.bfloat16, 128),
                                            (torch.float32, 80), (torch.bfloat16, 256)])  # 256: Gemma 2
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_cpu_decode_kernel(name, dtype, head_dim, block_size):
    # bf16 pages with a head size that is a multiple of 32 take the AVX512-BF16 kernel where the
    # CPU has it; GQA group 7 walks the pages twice (4 + 3 heads).
    batch = Batch(LONG_DECODE, block_size, 14, 2, head_dim, dtype, "cpu", fragmented=True)
    args = variant_args(name, 14)
    expected = reference.paged_attention(batch.query.float(), batch.k_cache.float(), batch.v_cache.float(),
                                         *batch.attention_args()[3:], **args)
    out = torch.empty_like(batch.query)
    torch.ops.splitserve_cpu.paged_decode(out, batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
                                          batch.seq_lens, batch.scale, args["window"], args["softcap"],
                                          args["sinks"])
    assert not torch.isnan(out).any(), "read a slot outside a sequence's context"
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@needs_cpu_kernels
@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("scenario", ["prefill", "chunked", "mixed"])
@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 256)])
def test_cpu_prefill_kernel(name, scenario, block_size, dtype, head_dim):
    # A long chunk after cached context as well: its tiles start past some rows' windows.
    batch = Batch(SCENARIOS[scenario] + [(37, 50)], block_size, 9, 3, head_dim, dtype, "cpu", fragmented=True,
                  seed=5)
    args = variant_args(name, 9)
    num_decodes = next((i for i, n in enumerate(batch.q_lens) if n != 1), len(batch.q_lens))
    out = torch.full_like(batch.query, 7.0)
    torch.ops.splitserve_cpu.paged_prefill(out, batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
                                           batch.query_start_loc, batch.seq_lens, num_decodes, batch.scale,
                                           args["window"], args["softcap"], args["sinks"])
    expected = reference.paged_attention(batch.query.float(), batch.k_cache.float(), batch.v_cache.float(),
                                         *batch.attention_args()[3:], **args)
    first = int(batch.query_start_loc[num_decodes])
    assert (out[:first] == 7.0).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[first:].float(), expected[first:], rtol=tol, atol=tol)


def _backends():
    return [pytest.param("torch", id="torch"),
            pytest.param("cpu", id="cpu", marks=needs_cpu_kernels)]


def _backend(name):
    if name == "cpu":
        from splitserve.engine.attention.cpu_backend import CpuAttentionBackend
        return CpuAttentionBackend()
    return TorchAttentionBackend()


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("pages", ["float32", "int8"])
def test_backend_step(backend, name, pages):
    # Decodes first (the runner's order), a whole prefill longer than the windows, and a chunk over
    # cached context.
    q_lens, ctx_lens = [1, 1, 1, 45, 12], [7, 60, 16, 45, 52]
    query, key, value, k_cache, v_cache, layout = make_batch(q_lens, ctx_lens, 8, 40, 9, 3, 16, seed=2)
    args = variant_args(name, 9)

    def reference_over(k_pages, v_pages):
        k_pages, v_pages = k_pages.clone(), v_pages.clone()
        reference.write_kv(key, value, k_pages, v_pages, layout.slot_mapping)
        return reference.paged_attention(query, k_pages, v_pages, layout.block_tables, layout.query_start_loc,
                                         layout.seq_lens, 0.25, **args)
    expected = reference_over(k_cache, v_cache)
    if pages == "int8":
        k_cache, v_cache = quantize(k_cache, kv_quant("int8")), quantize(v_cache, kv_quant("int8"))
        over_float_pages, expected = expected, reference_over(k_cache, v_cache)
        if backend == "cpu":  # a whole-prompt chunk attends to its fresh K/V there, not to their codes
            expected[3:48] = over_float_pages[3:48]
    b = _backend(backend)
    got = b.forward(query, key, value, k_cache, v_cache, layout, b.prepare(layout), 0.25, AttentionVariant(**args))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


triton_interpreted = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU tensors need the Triton interpreter (the GPU check runs the compiled kernels)")


@triton_interpreted
@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_triton_kernels(name, scenario):
    from splitserve.engine.attention import triton_kernels
    if not triton_kernels.TRITON_AVAILABLE:
        pytest.skip("triton is not installed")
    batch = Batch(SCENARIOS[scenario] + [(30, 1)] * (scenario == "decode") + [(0, 1)], 8, 6, 2, 16,
                  torch.float32, "cpu", fragmented=True)
    args = variant_args(name, 6)
    out = triton_kernels.paged_attention(*batch.attention_args(), **args)
    torch.testing.assert_close(out, reference.paged_attention(*batch.attention_args(), **args),
                               atol=1e-5, rtol=1e-5)


@triton_interpreted
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_triton_split_decode(name):
    # Contexts cut into 64-position partitions: a window may leave whole partitions empty, and the
    # sinks join the first partition only.
    from splitserve.engine.attention import triton_decode, triton_kernels
    if not triton_kernels.TRITON_AVAILABLE:
        pytest.skip("triton is not installed")
    batch = Batch([(150, 1), (70, 1), (3, 1)], 16, 6, 2, 16, torch.float32, "cpu", fragmented=True)
    args = variant_args(name, 6)
    out = triton_decode.paged_decode(*batch.attention_args(), num_splits=3, split_len=64, **args)
    torch.testing.assert_close(out, reference.paged_attention(*batch.attention_args(), **args),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", _backends())
def test_the_op_carries_the_variants_through_a_compiled_graph(backend):
    """The paged attention op as a compiled step calls it: the window, soft-cap and sinks tensor
    are graph inputs of one opaque node (fullgraph: no break), and the result is the reference's."""
    from splitserve.engine.attention.hf_integration import StepContext, step_context
    q_lens, ctx_lens = [1, 1, 30], [40, 9, 30]
    query, key, value, k_cache, v_cache, layout = make_batch(q_lens, ctx_lens, 8, 16, 9, 3, 16, seed=4)
    args = variant_args("window23-softcap-sinks", 9)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, value, ref_k, ref_v, layout.slot_mapping)
    expected = reference.paged_attention(query, ref_k, ref_v, layout.block_tables, layout.query_start_loc,
                                         layout.seq_lens, 0.25, **args)
    b = _backend(backend)

    def layer(q, k, v, sinks):
        return torch.ops.splitserve.paged_attention(q, k, v, 0, 0.25, args["window"], args["softcap"], sinks) * 1.0

    with step_context(StepContext(b, layout, b.prepare(layout), [(k_cache, v_cache)])):
        got = torch.compile(layer, fullgraph=True, backend="eager")(query, key, value, args["sinks"])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
