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

_LOG2E = 1.4426950408889634  # log2(e)

# Context positions per inner-loop step of the attention kernels.
_BLOCK_N = 64


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _require_triton() -> None:
    if not TRITON_AVAILABLE:
        raise RuntimeError("triton is not installed; use engine.attention.reference instead")


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
else:
    _dot = None
    _online_softmax_step = None

# Whether the kernels are decorated in interpreter mode (TRITON_INTERPRET=1 at import time).
_INTERPRETED = TRITON_AVAILABLE and type(_dot).__name__ == "InterpretedFunction"
