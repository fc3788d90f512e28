"""What the Triton kernel modules share: the import guard, constants and the fp32-accumulating dot."""
from __future__ import annotations

try:  # pragma: no cover - exercised implicitly by the import
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    TRITON_AVAILABLE = False

import torch

from splitserve.engine.attention.kv_quant import of_storage

_LOG2E = 1.4426950408889634  # log2(e)

# Context positions per inner-loop step of the attention kernels.
_BLOCK_N = 64


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _scale_views(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantized caches as float32 (the kernels read and write each row's scale through these);
    plain caches are passed as they are, unread."""
    if of_storage(k_cache.dtype) is None:
        return k_cache, v_cache
    return k_cache.view(torch.float32), v_cache.view(torch.float32)


def _dot_precision(query: torch.Tensor, k_cache: torch.Tensor) -> str:
    """ieee for float32 operands: the cache's dtype, or the query's when pages are dequantized to it."""
    operand = query.dtype if of_storage(k_cache.dtype) else k_cache.dtype
    return "ieee" if operand == torch.float32 else "tf32"


def _sinks_or(sinks: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The sinks (float32, contiguous: ``AttentionVariant``), or any tensor standing in, unread, without."""
    return like if sinks is None else sinks


def _require_triton() -> None:
    if not TRITON_AVAILABLE:
        raise RuntimeError("triton is not installed; use splitserve.engine.attention.reference instead")


if TRITON_AVAILABLE:

    @triton.jit
    def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """a @ b accumulated in float32.  UPCAST: multiply in float32 (used under the
        interpreter, whose tl.dot multiplies the raw uint16 bits of bfloat16 operands)."""
        if UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b, input_precision=PRECISION)

    @triton.jit
    def _online_softmax_step(m_i, l_i, acc, s, v, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """Fold one tile of base-2 scores ``s`` [rows, n] and its values ``v`` [n, D] into the
        running max ``m_i``, sum ``l_i`` and unnormalised output ``acc``; masked scores are -inf."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        return m_new, l_i, acc

    @triton.jit
    def _variant_scores(s, scale_log2, SOFTCAP: tl.constexpr, softcap):
        """Raw dot products ``s`` -> base-2 scores; with SOFTCAP, capped first as
        softcap * tanh(s * scale / softcap) (tanh through exp: the interpreter has no tanh)."""
        if SOFTCAP:
            y = s * (scale_log2 / 1.4426950408889634) / softcap
            t = 2.0 / (1.0 + tl.exp(-2.0 * y)) - 1.0
            return t * (softcap * 1.4426950408889634)
        else:
            return s * scale_log2

    @triton.jit
    def _load_kv(cache_ptr, scale_ptr, row, d, p_mask, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr, OUT_DTYPE):
        """A tile of K or V rows [n, BLOCK_D] starting at element offsets ``row`` [n] of the cache.

        QUANT: the cache holds rows of HEAD_DIM 8-bit codes + a float32 scale (kv_quant);
        ``scale_ptr`` is the same memory viewed as float32, where a row's scale sits at element
        ``row / 4 + HEAD_DIM / 4`` (row widths are multiples of 4 bytes). Dequantized to OUT_DTYPE."""
        mask = p_mask[:, None] & (d[None, :] < HEAD_DIM)
        x = tl.load(cache_ptr + row[:, None] + d[None, :], mask=mask, other=0.0)
        if QUANT:
            scale = tl.load(scale_ptr + row // 4 + HEAD_DIM // 4, mask=p_mask, other=0.0)
            x = (x.to(tl.float32) * scale[:, None]).to(OUT_DTYPE)
        return x

    @triton.jit
    def _store_quantized(x, dst, scale_dst, mask, h_mask, QMAX: tl.constexpr, ROUND: tl.constexpr):
        """Rows ``x`` [BLOCK_H, BLOCK_D] (zeros past HEAD_DIM) as codes at ``dst`` and each row's float32
        scale at ``scale_dst`` [BLOCK_H]: scale = amax / QMAX, code = x / scale (kv_quant.quantize;
        ROUND, for int8, rounds half up where torch rounds half to even: a tie is one code apart)."""
        x = x.to(tl.float32)
        scale = tl.max(tl.abs(x), 1) / QMAX
        inv = tl.where(scale > 0, 1.0 / scale, 0.0)
        codes = tl.minimum(tl.maximum(x * inv[:, None], -QMAX), QMAX)
        if ROUND:
            codes = tl.floor(codes + 0.5)
        tl.store(dst, codes.to(dst.dtype.element_ty), mask=mask)
        tl.store(scale_dst, scale, mask=h_mask)

else:
    _dot = None
    _variant_scores = None
    _online_softmax_step = None
    _load_kv = None
    _store_quantized = None

# Whether the kernels are decorated in interpreter mode (TRITON_INTERPRET=1 at import time).
_INTERPRETED = TRITON_AVAILABLE and type(_dot).__name__ == "InterpretedFunction"
