"""One Triton launch for a projection of every expert: rows sorted by expert, each tile of rows
multiplied by its own expert's weight (a grouped GEMM, as vLLM's fused MoE kernel does it). LoRA
adapters use it too, an adapter slot for an expert (``splitserve.engine.lora.layers``).

The tile schedule is built on the device with fixed shapes (``tile_schedule``), so the launch
needs no host sync and fits in a compiled graph or a CUDA graph: at most ``ceil(S / BLOCK_M) +
E`` tiles for S rows over E experts; tiles past the last one carry expert E and do nothing.
The launch is the custom op ``splitserve::moe_grouped_gemm``, opaque to ``torch.compile``.
Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (the tests' way).
"""
from __future__ import annotations

import torch

from splitserve.engine.attention.triton_common import _INTERPRETED, TRITON_AVAILABLE, _dot, triton, tl

BLOCK_M = 16


def tile_schedule(counts: torch.Tensor, num_rows: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, ...]:
    """(expert, first row, end row) of every tile over rows sorted by expert, ``counts[e]`` rows
    of expert e; unused tiles get expert ``len(counts)``. All on ``counts``' device, fixed sizes."""
    num_experts = counts.numel()
    max_tiles = -(-num_rows // block_m) + num_experts
    tiles = (counts + block_m - 1) // block_m
    tiles_end = torch.cumsum(tiles, 0)
    rows_start = torch.cumsum(counts, 0) - counts
    t = torch.arange(max_tiles, device=counts.device)
    expert = torch.searchsorted(tiles_end, t, right=True)
    e = expert.clamp(max=num_experts - 1)
    start = rows_start[e] + (t - (tiles_end[e] - tiles[e])) * block_m
    end = rows_start[e] + counts[e]
    return expert.to(torch.int32), start.to(torch.int32), end.to(torch.int32)


if TRITON_AVAILABLE:
    @triton.jit
    def _grouped_gemm_kernel(a_ptr, rows_ptr, w_ptr, bias_ptr, out_ptr,
                             tile_expert_ptr, tile_start_ptr, tile_end_ptr,
                             N, K, num_experts,
                             stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_be, stride_om,
                             GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                             UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(tile_expert_ptr + pid_m)
        if expert < num_experts:
            start = tl.load(tile_start_ptr + pid_m)
            end = tl.load(tile_end_ptr + pid_m)
            offs_m = start + tl.arange(0, BLOCK_M)
            m_mask = offs_m < end
            if GATHER:  # row i of the sorted order reads row rows[i] of a (a token, once per expert it chose)
                a_rows = tl.load(rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
            else:
                a_rows = offs_m.to(tl.int64)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < N
            w_base = w_ptr + expert.to(tl.int64) * stride_we
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < K
                a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                            mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                w = tl.load(w_base + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                            mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                acc += _dot(a, w, PRECISION, UPCAST)
            if HAS_BIAS:
                bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + offs_n, mask=n_mask, other=0.0)
                acc += bias.to(tl.float32)[None, :]
            tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def grouped_gemm(a: torch.Tensor, rows: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                 tile_expert: torch.Tensor, tile_start: torch.Tensor, tile_end: torch.Tensor, num_rows: int,
                 transposed: bool, zero_rest: bool = False) -> torch.Tensor:
    """[num_rows, N]: row i = a[rows[i]] (or a[i]) @ W[e]^T + bias[e], e the expert of i's tile.
    ``weight`` [E, N, K] (``transposed``: [E, K, N], gpt-oss's layout), any strides; ``bias``
    [E, N] or None. Rows no tile covers are left as they are (``zero_rest``: zeros)."""
    num_experts = weight.shape[0]
    if transposed:
        k_dim, n_dim = weight.shape[1], weight.shape[2]
        stride_wk, stride_wn = weight.stride(1), weight.stride(2)
    else:
        n_dim, k_dim = weight.shape[1], weight.shape[2]
        stride_wn, stride_wk = weight.stride(1), weight.stride(2)
    out = (torch.zeros if zero_rest else torch.empty)((num_rows, n_dim), dtype=weight.dtype, device=a.device)
    if num_rows == 0:
        return out
    a = a.to(weight.dtype)
    block_n = min(64, max(16, _next_pow2(n_dim)))
    block_k = min(64, max(16, _next_pow2(k_dim)))
    grid = (tile_expert.numel(), -(-n_dim // block_n))
    _grouped_gemm_kernel[grid](
        a, rows if rows is not None else tile_start, weight, bias if bias is not None else weight, out,
        tile_expert, tile_start, tile_end, n_dim, k_dim, num_experts,
        a.stride(0), a.stride(1), weight.stride(0), stride_wn, stride_wk,
        bias.stride(0) if bias is not None else 0, out.stride(0),
        GATHER=rows is not None, HAS_BIAS=bias is not None,
        PRECISION="ieee" if weight.dtype == torch.float32 else "tf32", UPCAST=_INTERPRETED,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


# Opaque to torch.compile: the graph keeps one node per projection (as the attention op).
_lib = torch.library.Library("splitserve", "FRAGMENT")
_lib.define("moe_grouped_gemm(Tensor a, Tensor? rows, Tensor weight, Tensor? bias, Tensor tile_expert, "
            "Tensor tile_start, Tensor tile_end, SymInt num_rows, bool transposed, bool zero_rest=False) -> Tensor")
_lib.impl("moe_grouped_gemm", grouped_gemm, "CompositeExplicitAutograd")


@torch.library.register_fake("splitserve::moe_grouped_gemm")
def _(a, rows, weight, bias, tile_expert, tile_start, tile_end, num_rows, transposed, zero_rest=False):
    return a.new_empty((num_rows, weight.shape[2] if transposed else weight.shape[1]), dtype=weight.dtype)
