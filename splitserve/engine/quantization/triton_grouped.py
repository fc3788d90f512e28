"""The group-wise quantized matmul on GPUs: one Triton kernel that de-quantizes in registers.

Each program computes a BLOCK_M x BLOCK_N tile of ``x @ W^T``; it walks K 32 codes at a time (a
group is a multiple of 16, so each 16-code half has one scale and one offset per channel), loads
the codes of its BLOCK_N channels (16 bytes for 32 4-bit codes in GGUF's order: the low nibbles are
codes 0-15, the high ones 16-31; or 32 one-byte int8/fp8 codes), turns them into the float weight
(``code * scale + offset``, the form every format was converted to) and accumulates two 16-deep
dots in float32. The weight never exists de-quantized in memory: a decode step reads 4 or 8 bits
a weight, plus the scales.

On a CPU tensor it runs only under ``TRITON_INTERPRET=1`` (the tests check it there, at small
shapes); the CPU path is the C++ kernel.
"""
from __future__ import annotations

import torch

from splitserve.engine.attention.triton_common import TRITON_AVAILABLE, tl, triton

if TRITON_AVAILABLE:

    @triton.jit
    def _grouped_matmul_kernel(x_ptr, codes_ptr, scales_ptr, offsets_ptr, out_ptr, M, N, K, groups_per_row,
                               stride_xm, stride_om, row_bytes,
                               BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        half = tl.arange(0, 16)
        row_ok = rows < M
        col_ok = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, 32):
            # The groups of the two 16-code halves (the same one unless groups are 16 wide).
            g_lo = cols * groups_per_row + k // GROUP
            g_hi = cols * groups_per_row + (k + 16) // GROUP
            scale_lo = tl.load(scales_ptr + g_lo, mask=col_ok, other=0.0)
            scale_hi = tl.load(scales_ptr + g_hi, mask=col_ok, other=0.0)
            if HAS_OFFSETS:
                offset_lo = tl.load(offsets_ptr + g_lo, mask=col_ok, other=0.0)
                offset_hi = tl.load(offsets_ptr + g_hi, mask=col_ok, other=0.0)
            else:
                offset_lo = tl.zeros((BLOCK_N,), dtype=tl.float32)
                offset_hi = offset_lo
            if BITS == 4:
                packed = tl.load(codes_ptr + cols[:, None] * row_bytes + k // 2 + half[None, :],
                                 mask=col_ok[:, None], other=0)
                lo = (packed & 0xF).to(tl.float32)
                hi = (packed >> 4).to(tl.float32)
            else:
                lo = tl.load(codes_ptr + cols[:, None] * row_bytes + k + half[None, :],
                             mask=col_ok[:, None], other=0).to(tl.float32)
                hi = tl.load(codes_ptr + cols[:, None] * row_bytes + k + 16 + half[None, :],
                             mask=col_ok[:, None], other=0).to(tl.float32)
            w_lo = lo * scale_lo[:, None] + offset_lo[:, None]
            w_hi = hi * scale_hi[:, None] + offset_hi[:, None]
            x_lo = tl.load(x_ptr + rows[:, None] * stride_xm + k + half[None, :], mask=row_ok[:, None], other=0.0)
            x_hi = tl.load(x_ptr + rows[:, None] * stride_xm + k + 16 + half[None, :], mask=row_ok[:, None],
                           other=0.0)
            # float32 activations: float32 dots; half-precision ones: the weight rounded to their
            # dtype for the tensor cores, accumulated in float32.
            acc += tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)), input_precision=DOT_PRECISION)
            acc += tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)), input_precision=DOT_PRECISION)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def grouped_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                   bits: int, group_size: int) -> torch.Tensor:
    """x [M, K] @ (the weight codes, scales and offsets stand for)^T -> [M, N] in x's dtype."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("the GPU path of quantized linears needs Triton")
    x = x.contiguous()
    m, k = x.shape
    n = codes.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    block_n = 64
    codes_u8 = codes.view(torch.uint8) if bits == 4 else codes
    if codes_u8.dtype == torch.float8_e4m3fn and x.device.type == "cpu":
        codes_u8 = codes_u8.float()  # the interpreter cannot load fp8 from a CPU tensor; values unchanged
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _grouped_matmul_kernel[grid](
        x, codes_u8, scales, offsets if offsets is not None else scales, out, m, n, k, k // group_size,
        x.stride(0), out.stride(0), codes_u8.shape[1],
        BITS=bits, GROUP=group_size, HAS_OFFSETS=offsets is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee")
    return out


def fp8_rowwise_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` with row-wise scales runs here (Hopper-class GPUs: compute
    capability 9.0 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def fp8_scaled_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16) @ (fp8 codes [N, K] * scales [N, 1])^T through the GPU's fp8 tensor cores:
    the activations quantized to e4m3 per row (dynamic, as vLLM's fp8 path does), both scales
    applied by ``torch._scaled_mm`` to the float32 accumulator."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    x_scale = amax / 448.0
    x_fp8 = (x.float() / x_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return torch._scaled_mm(x_fp8, codes.t(), scale_a=x_scale, scale_b=scales.reshape(1, -1).float(),
                            out_dtype=x.dtype)
