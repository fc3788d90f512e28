"""Random KV pools for the transport tests, plain or quantized (splitserve/engine/attention/kv_quant.py)."""
import torch

from splitserve.engine.attention.kv_quant import kv_quant, quantize

# The pool formats the per-transport tests run over: plain floats, and quantized pages (codes +
# a float32 scale per row), which every transport must ship byte for byte as they are.
QUANTIZED = ("int8", "fp8_e4m3")


def random_pool(shape, dtype, generator: torch.Generator | None = None) -> torch.Tensor:
    """Unit-normal K/V of ``shape`` (last dim: head size) as a pool of ``dtype``: a torch dtype or its
    name, or a quantized KV format name, whose rows are then ``head size + 4`` wide."""
    values = torch.randn(*shape, generator=generator)
    if isinstance(dtype, str) and dtype in QUANTIZED + ("fp8_e5m2",):
        return quantize(values, kv_quant(dtype))
    return values.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
