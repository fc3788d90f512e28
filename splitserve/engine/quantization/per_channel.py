"""Quantized weights (``--quantization``, vLLM's flag): the linear layers of a loaded model replaced
by quantized ones, inside the compiled step like any other module.

``int8`` and ``fp8``: weight-only, quantized at load from the checkpoint's weights. Each output
channel of a linear layer keeps 8-bit codes and one float32 scale (symmetric: scale = max |w| /
qmax, code = w / scale rounded to the format: int8 with qmax 127, or fp8 e4m3 with qmax 448, whose
3 mantissa bits keep the relative error of small weights where int8's steps are uniform): a quarter
of fp32's weight bytes, half of bf16's. On the CPU the matmul is
``csrc/linear_quantized_cpu.cpp``: the codes are widened to float32 in registers right before their
multiply-adds (never a float copy of the weight), the scale applied to each finished dot product,
activations kept in their own dtype (float32 stays float32: the same arithmetic as a float GEMM
over the de-quantized weight, up to the order of the additions). torch's own int8 kernel
(``aten::_weight_int8pack_mm``) was measured first: 3-6x a bf16 GEMM at one row, but its float32
path ran 6x slower than an fp32 GEMM and its many-row path 2.5x slower than bf16's. Elsewhere
(CUDA) the weight is de-quantized for each call: correct, not fast (a Triton kernel is to come).

Every linear of the decoder layers and the output projection is quantized (a tied output
projection gets an int8 copy of its own; the embedding lookup keeps the float table). Experts
that ``transformers`` stores as 3-D tensors (not ``nn.Linear``) keep their float weights. Shards
of a tensor-parallel model are quantized after sharding, so each rank's scales are its own rows'.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from splitserve.engine.config import check_quantization

log = logging.getLogger(__name__)


# Each method's code dtype and the largest code a channel's max |w| maps onto.
CODE_FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


def w8_matmul(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """rows [M, in] x (codes [out, in] 8-bit * scales [out] float32) transposed -> [M, out], in the
    rows' dtype: the de-quantized weight for this call (the portable path)."""
    return torch.nn.functional.linear(rows, (codes.float() * scales[:, None]).to(rows.dtype))


def _matmul_op(device: torch.device):
    """The C++ kernel on a CPU where the kernels built (its shape rule registered for the
    compiled step once), the portable path elsewhere."""
    from splitserve.engine.attention import cpu_kernels
    if device.type != "cpu" or not cpu_kernels.available():
        return w8_matmul
    global _fake_registered
    if not _fake_registered:
        torch.library.register_fake("splitserve_cpu::linear_w8")(
            lambda rows, codes, scales: rows.new_empty((rows.shape[0], codes.shape[0])))
        _fake_registered = True
    return torch.ops.splitserve_cpu.linear_w8


_fake_registered = False


class QuantizedLinear(torch.nn.Module):
    """A linear layer with 8-bit weights (``method``: int8 or fp8), one float32 scale per output
    channel; activations and output in the model's dtype."""

    def __init__(self, linear: torch.nn.Linear, method: str = "int8"):
        super().__init__()
        code_dtype, qmax = CODE_FORMATS[method]
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / qmax
        self.in_features, self.out_features, self.method = linear.in_features, linear.out_features, method
        scaled = (weight / scale[:, None]).clamp(-qmax, qmax)
        self.register_buffer("codes", (torch.round(scaled) if method == "int8" else scaled).to(code_dtype))
        self.register_buffer("scales", scale)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias)
        self.op = _matmul_op(weight.device)

    def dequantized(self) -> torch.Tensor:
        """The weight these codes stand for, [out, in] float32 (what a reference model is given)."""
        return self.codes.float() * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.op(x.reshape(-1, self.in_features), self.codes, self.scales)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.method} per-channel"


@dataclass(frozen=True)
class QuantizedWeights:
    """What quantizing a model did."""

    # Linear layers replaced.
    layers: int
    # Bytes of their weights before and after (codes + scales).
    bytes_before: int
    bytes_after: int


# Methods that quantize the output projection too. fp8 leaves it in float, as vLLM's online fp8 and
# compressed-tensors' FP8 recipes do: with it in e4m3 (3 mantissa bits) SmolLM2-135M's perplexity
# rose 5.3 %, with it float 2.1 % (docs/performance.md#quantized-at-load). int8 costs it 0.8 %
# in all and saves most where it matters most (a small model's vocabulary is a third of it).
QUANTIZES_OUTPUT_PROJECTION = {"int8": True, "fp8": False}


def linears_to_quantize(model: torch.nn.Module, method: str) -> list[tuple[str, torch.nn.Linear]]:
    """The linear layers ``method`` quantizes: every one, the output projection only where
    ``QUANTIZES_OUTPUT_PROJECTION`` says so."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [(name, module) for name, module in model.named_modules()
            if type(module) is torch.nn.Linear and (module is not head or QUANTIZES_OUTPUT_PROJECTION[method])]


def quantize_model(model: torch.nn.Module, method: str) -> QuantizedWeights:
    """Replace the linear layers of ``model`` that ``linears_to_quantize`` names, in place."""
    check_quantization(method)
    targets = linears_to_quantize(model, method)
    before = after = 0
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        quantized = QuantizedLinear(module, method)
        before += module.weight.numel() * module.weight.element_size()
        after += quantized.codes.numel() + quantized.scales.numel() * 4
        setattr(model.get_submodule(parent_name), child, quantized)
    log.info("quantized %d linear layers to %s: %.1f -> %.1f MiB of weights", len(targets), method,
             before / 2**20, after / 2**20)
    return QuantizedWeights(len(targets), before, after)
