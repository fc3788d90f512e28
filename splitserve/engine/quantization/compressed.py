"""FP8 and compressed-tensors checkpoints: codes and scales stored beside each linear's name.

* ``quant_method: fp8`` (the FP8 checkpoints vLLM and transformers read): ``weight`` in float8
  e4m3, ``weight_scale`` per tensor (or per channel), or ``weight_scale_inv`` per block
  (``weight_block_size``, e.g. [128, 128]); ``w = code * scale``.
* ``quant_method: compressed-tensors`` (what llm-compressor writes), by ``format``:
  ``float-quantized`` (fp8 ``weight`` + ``weight_scale``), ``int-quantized`` /
  ``naive-quantized`` (int8 ``weight``, ``weight_scale``, maybe ``weight_zero_point``) and
  ``pack-quantized`` (4/8-bit codes offset to unsigned and packed into int32 ``weight_packed``
  along the input dimension, low bits first; zero points, if any, packed along the output
  dimension); scales per tensor, channel, group or block; ``w = (code - zero) * scale``.

Activations are not quantized here: an ``input_scale`` (static activation quantization) is
ignored, and the matmul runs in the model's dtype over the exact de-quantized weight (weight-only,
as vLLM runs FP8 checkpoints on hardware without FP8 matmuls).
"""
from __future__ import annotations

import re

import torch

from splitserve.engine.quantization.gptq_awq import unpack_words
from splitserve.engine.quantization.grouped import QuantizedTensor, pack_nibbles

FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
PARTS = ("weight", "weight_packed", "weight_scale", "weight_scale_inv", "weight_zero_point", "weight_shape",
         "input_scale")


def _per_group(scale: torch.Tensor, out_features: int, in_features: int, block: tuple[int, int] | None):
    """A tensor, channel, group or block scale -> [out, groups] float32, and the group size."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(out_features, 1).contiguous(), in_features
    if scale.dim() == 1 or (scale.dim() == 2 and scale.shape[1] == 1 and scale.shape[0] == out_features):
        return scale.reshape(out_features, 1).contiguous(), in_features
    if block is not None:  # [ceil(out / bn), ceil(in / bk)]
        rows, cols = block
        if in_features % cols:
            raise ValueError(f"block size {cols} does not divide {in_features} input channels")
        return scale.repeat_interleave(rows, dim=0)[:out_features].contiguous(), cols
    if scale.shape[0] != out_features or in_features % scale.shape[1]:
        raise ValueError(f"a scale of shape {tuple(scale.shape)} does not fit a [{out_features}, {in_features}] weight")
    return scale.contiguous(), in_features // scale.shape[1]


def read_fp8(name: str, tensors: dict[str, torch.Tensor], config: dict) -> QuantizedTensor:
    """One linear of a ``quant_method: fp8`` checkpoint."""
    weight = tensors["weight"]
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}.weight is {weight.dtype}; FP8 checkpoints hold float8_e4m3fn weights")
    block = config.get("weight_block_size")
    scale = tensors.get("weight_scale_inv", tensors.get("weight_scale"))
    if scale is None:
        raise ValueError(f"{name} has an fp8 weight but no weight_scale")
    scales, group = _per_group(scale, *weight.shape, tuple(block) if block else None)
    return QuantizedTensor(f"{name}.weight", weight.contiguous(), scales, None, bits=8, group_size=group,
                           fmt="FP8" + (f" blocks {block[0]}x{block[1]}" if block else ""))


def _scheme_for(name: str, config: dict) -> dict:
    """The weights' quantization args of the config group whose targets name this linear."""
    for group in config.get("config_groups", {}).values():
        for target in group.get("targets", []):
            if target == "Linear" or (target.startswith("re:") and re.match(target[3:], name)) or target == name:
                return group.get("weights") or {}
    raise ValueError(f"{name} is quantized, but no config group of quantization_config targets it")


def read_compressed(name: str, tensors: dict[str, torch.Tensor], config: dict) -> QuantizedTensor:
    """One linear of a ``quant_method: compressed-tensors`` checkpoint."""
    fmt = config.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported ({', '.join(FORMATS)} are)")
    args = _scheme_for(name, config)
    bits, kind = int(args.get("num_bits", 8)), args.get("type", "int")
    block = tuple(args["block_structure"]) if args.get("block_structure") else None
    zero = tensors.get("weight_zero_point")
    if fmt == "pack-quantized":
        if bits not in (4, 8):
            raise ValueError(f"{name}: {bits}-bit pack-quantized weights are not supported (4 and 8 are)")
        out_features, in_features = (int(v) for v in tensors["weight_shape"].tolist())
        unsigned = unpack_words(tensors["weight_packed"], bits, dim=1)[:, :in_features]
        scales, group = _per_group(tensors["weight_scale"], out_features, in_features, block)
        half = 1 << (bits - 1)  # codes and zero points are stored offset by this
        if zero is not None:
            zero = unpack_words(zero, bits, dim=0)[:out_features].float() - half
        offsets = -(zero if zero is not None else torch.zeros_like(scales)) * scales
        if bits == 4:  # w = (u - half - zero) * s: the unsigned code, the offset moved by half
            return QuantizedTensor(f"{name}.weight", pack_nibbles(unsigned), scales, offsets - half * scales,
                                   bits=4, group_size=group, fmt="compressed-tensors int4")
        return QuantizedTensor(f"{name}.weight", (unsigned - half).to(torch.int8), scales, offsets,
                               bits=8, group_size=group, fmt="compressed-tensors int8")
    weight = tensors["weight"]
    expected = torch.float8_e4m3fn if kind == "float" else torch.int8
    if bits != 8 or weight.dtype != expected:
        raise ValueError(f"{name}: {fmt} weights of {bits} bits stored as {weight.dtype} are not supported "
                         "(8-bit float8_e4m3fn or int8 are)")
    scales, group = _per_group(tensors["weight_scale"], *weight.shape, block)
    offsets = None
    if zero is not None and bool((zero != 0).any()):
        offsets = -_per_group(zero, *weight.shape, block)[0] * scales
    return QuantizedTensor(f"{name}.weight", weight.contiguous(), scales, offsets, bits=8, group_size=group,
                           fmt=f"compressed-tensors {'fp8' if kind == 'float' else 'int8'}")
