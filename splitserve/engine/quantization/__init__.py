"""Quantized weights (``--quantization``, vLLM's flag and names).

Two ways in:

* quantized at load (``int8``, ``fp8``): a float checkpoint's linears get 8-bit codes with one scale
  per output channel (:mod:`.per_channel`);
* quantized checkpoints (``gguf``; and the formats :mod:`.checkpoint` names): the shipped codes are
  kept as they are, in the group-wise form of :mod:`.grouped`, and the model is built around them
  without a float copy of its linears ever existing.
"""
from splitserve.engine.quantization.per_channel import (  # noqa: F401 (the package's public names)
    CODE_FORMATS,
    QuantizedLinear,
    QuantizedWeights,
    quantize_model,
    w8_matmul,
)
