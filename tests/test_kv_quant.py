"""Quantized KV pages (splitserve/engine/attention/kv_quant.py): the row format, and every attention backend
reading them against the fp32 reference.

Two checks per backend and format: against the reference over the *same quantized* pages
(tight: the kernel dequantizes exactly as the format says) and against the reference over the
unquantized fp32 K/V (loose: the error quantization itself costs, bounded per format).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from splitserve.engine.attention import cpu_kernels, kv_quant, reference  # noqa: E402
from splitserve.engine.attention.kv_quant import dequantize, quantize  # noqa: E402
from splitserve.engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from tests.test_cpu_attention import make_batch  # noqa: E402

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
# Largest |error| of one dequantized value, relative to its row's amax: half a code step for
# int8; for fp8 half an ulp relative to the value (3 / 2 mantissa bits) bounds it.
ROW_ERROR = {"int8": 0.5 / 127 + 1e-6, "fp8_e4m3": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3}
# Largest |attention output - fp32 attention output| on unit-normal K/V: 2-3x the largest seen
# over three seeds (0.021, 0.064, 0.155), far below what unscaled or misread pages give (~1).
ATTN_ERROR = {"int8": 0.05, "fp8_e4m3": 0.15, "fp8_e5m2": 0.35}


@pytest.mark.parametrize("name", FORMATS)
def test_rows_round_trip_within_a_code_step(name):
    fmt = kv_quant.kv_quant(name)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]  # rows of very different sizes
    x[0, 0] = 0.0  # an all-zero row keeps scale 0, not NaN
    rows = quantize(x, fmt)
    assert rows.dtype == fmt.storage and rows.shape == (50, 3, 68)
    back = dequantize(rows)
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.all((back - x).abs() <= ROW_ERROR[name] * amax + 1e-30)
    assert torch.equal(back[0, 0], torch.zeros(64))


def test_fp8_means_e4m3_and_names_are_checked():
    assert kv_quant.kv_quant("fp8") == kv_quant.kv_quant("fp8_e4m3")
    assert kv_quant.kv_quant("auto") is None
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_quant.kv_quant("int4")


def _backends():
    out = [pytest.param(TorchAttentionBackend, id="torch")]
    out.append(pytest.param("cpu", id="cpu",
                            marks=pytest.mark.skipif(not cpu_kernels.available(), reason="no CPU kernels")))
    out.append(pytest.param("triton", id="triton"))
    return out


def _make(backend):
    if backend == "cpu":
        from splitserve.engine.attention.cpu_backend import CpuAttentionBackend
        return CpuAttentionBackend()
    if backend == "triton":
        from splitserve.engine.attention import triton_kernels
        if not triton_kernels.TRITON_AVAILABLE:
            pytest.skip("triton is not installed")
        if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("CPU tensors need the Triton interpreter")
        from splitserve.engine.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    return backend()


# Decodes (two pages and a partial one) plus a prefill chunk after cached context.
Q_LENS, CTX_LENS = [1, 1, 1, 6], [40, 9, 17, 22]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("name", FORMATS)
def test_backend_reads_quantized_pages(backend, name):
    fmt = kv_quant.kv_quant(name)
    query, key, value, k_cache, v_cache, layout = make_batch(Q_LENS, CTX_LENS, 8, 24, 6, 2, 64, seed=3)
    scale = 64 ** -0.5
    # fp32 truth: the context as it was computed, the new tokens written unquantized.
    k32, v32 = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, value, k32, v32, layout.slot_mapping)
    truth = reference.paged_attention(query, k32, v32, layout.block_tables, layout.query_start_loc,
                                      layout.seq_lens, scale)

    kq, vq = quantize(k_cache, fmt), quantize(v_cache, fmt)
    attn = _make(backend)
    out = attn.forward(query, key, value, kq, vq, layout, attn.prepare(layout), scale)
    # The backend wrote the new tokens as quantized rows; the reference over those same pages.
    same_pages = reference.paged_attention(query, kq, vq, layout.block_tables, layout.query_start_loc,
                                           layout.seq_lens, scale)
    # A prefill chunk attends to its own fresh K/V where a backend has them (cpu: whole-context
    # chunks only, none here), so only decode rows and cached-context chunks compare tightly.
    torch.testing.assert_close(out, same_pages, atol=2e-4, rtol=2e-4)
    err = (out - truth).abs().max().item()
    assert 0 < err < ATTN_ERROR[name], err


@pytest.mark.skipif(not cpu_kernels.available(), reason="no CPU kernels")
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_writes_the_rows_torch_writes(name, in_dtype):
    fmt = kv_quant.kv_quant(name)
    key = (torch.randn(10, 2, 64) * 3).to(in_dtype)
    value = torch.randn(10, 2, 64).to(in_dtype)
    k_cache = torch.zeros(4, 8, 2, 68, dtype=fmt.storage)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 4, 5, 6, 7, 8, 20, 21, -1, 30])
    out = torch.empty(10, 4, 64, dtype=in_dtype)
    torch.ops.splitserve_cpu.write_and_decode(out, torch.zeros(10, 4, 64, dtype=in_dtype), key, value, k_cache,
                                              v_cache, slots, torch.zeros(1, 1, dtype=torch.int32),
                                              torch.zeros(1, dtype=torch.int32), 0, 1.0)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference.write_kv(key, value, k_ref, v_ref, slots)
    # Same codes and scales; fp8 rounding of a value right at a tie may differ by one code.
    for got, want in ((k_cache, k_ref), (v_cache, v_ref)):
        torch.testing.assert_close(dequantize(got), dequantize(want), atol=0, rtol=2.0 ** -3)
        assert (got.view(torch.uint8) != want.view(torch.uint8)).float().mean() < 0.01


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_reads_quantized_pages(name, num_splits):
    """The decode kernel whole and split into partitions (flash-decoding) over quantized pages."""
    from splitserve.engine.attention import triton_decode
    _make("triton")  # skips without triton / the interpreter
    fmt = kv_quant.kv_quant(name)
    query, key, value, k_cache, v_cache, layout = make_batch([1, 1], [130, 37], 16, 16, 4, 2, 64, seed=4)
    kq, vq = quantize(k_cache, fmt), quantize(v_cache, fmt)
    out = triton_decode.paged_decode(query, kq, vq, layout.block_tables, layout.query_start_loc, layout.seq_lens,
                                     0.125, num_splits=num_splits, split_len=64)
    same_pages = reference.paged_attention(query, kq, vq, layout.block_tables, layout.query_start_loc,
                                           layout.seq_lens, 0.125)
    torch.testing.assert_close(out, same_pages, atol=2e-4, rtol=2e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_on_cuda_reads_quantized_pages(name, dtype):
    """Compiled Triton on a GPU (not run on CPU-only machines): write, prefill and decode kernels."""
    from splitserve.engine.attention.triton_backend import TritonAttentionBackend
    fmt = kv_quant.kv_quant(name)
    query, key, value, k_cache, v_cache, layout = make_batch(Q_LENS, CTX_LENS, 8, 24, 6, 2, 64, seed=3)
    kq, vq = quantize(k_cache, fmt), quantize(v_cache, fmt)
    cuda = {f: getattr(layout, f).cuda() for f in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")}
    layout_cuda = type(layout)(**{**layout.__dict__, **cuda})
    attn = TritonAttentionBackend()
    kq_d, vq_d = kq.cuda(), vq.cuda()
    out = attn.forward(query.to(dtype).cuda(), key.to(dtype).cuda(), value.to(dtype).cuda(), kq_d, vq_d,
                       layout_cuda, attn.prepare(layout_cuda), 0.125)
    same_pages = reference.paged_attention(query, kq_d.cpu(), vq_d.cpu(), layout.block_tables,
                                           layout.query_start_loc, layout.seq_lens, 0.125)
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float().cpu(), same_pages, atol=tol, rtol=tol)
