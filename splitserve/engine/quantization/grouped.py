"""Group-wise quantized weights, the form every quantized checkpoint format is turned into.

A weight [out, in] is kept as 4- or 8-bit codes in groups of ``group_size`` (a multiple of 16)
consecutive input channels; each (output channel, group) has a float32 scale and, where the format has one, an
offset: ``w = code * scale + offset``. GGUF's Q4_0 (offset -8 d), Q4_1 (offset m) and Q8_0 (no
offset), GPTQ and AWQ (offset -zero * scale) all take this form without loss: the codes are
kept as shipped and the weight the kernel rebuilds is the one the format's own de-quantizer
computes, bit for bit (code * scale is exact in float32 for 4/8-bit codes and 16-bit scales).

4-bit codes sit two to a byte in GGUF's order: each 32 codes take 16 bytes, byte i holding code
i in its low nibble and code i + 16 in its high one. On the CPU the matmul is
``csrc/linear_quantized_cpu.cpp`` (``linear_wq``); elsewhere the weight is de-quantized per call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.attention import cpu_kernels

# Code widths the kernel reads.
BITS = (4, 8)


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantized weight read from a checkpoint, in :mod:`.grouped`'s form."""

    # The parameter it stands for (``model.layers.0.mlp.down_proj.weight``).
    name: str
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    bits: int
    group_size: int
    # A permutation of the input channels (GPTQ's activation order), or None.
    input_order: torch.Tensor | None = None
    # The format, for the module's description.
    fmt: str = ""


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (values 0..15, K a multiple of 32) -> [N, K / 2] uint8 in GGUF's order."""
    n, k = codes.shape
    halves = codes.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`: [N, K / 2] uint8 -> [N, K] uint8 codes."""
    n, half = packed.shape
    blocks = packed.reshape(n, half // 16, 1, 16)
    return torch.cat([blocks & 0xF, blocks >> 4], dim=2).reshape(n, half * 2)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, bits: int,
               group_size: int) -> torch.Tensor:
    """The float32 weight [N, K] that codes, scales and offsets stand for (what the kernel computes
    in registers; the portable path and the reference models use it)."""
    values = (unpack_nibbles(codes) if bits == 4 else codes).float()
    n, k = values.shape
    grouped = values.reshape(n, k // group_size, group_size) * scales[:, :, None]
    if offsets is not None:
        grouped = grouped + offsets[:, :, None]
    return grouped.reshape(n, k)


def _grouped_op(device: torch.device):
    """The C++ kernel on a CPU where the kernels built, the Triton kernel on a GPU, the portable
    path elsewhere (None)."""
    if device.type == "cuda":
        from splitserve.engine.quantization.triton_grouped import grouped_matmul
        return grouped_matmul
    if device.type != "cpu" or not _register_cpu_kernel():
        return None
    return torch.ops.splitserve_cpu.linear_wq


def _register_cpu_kernel() -> bool:
    """Whether the C++ kernel is there; its shape rule registered for compiled steps once. Called
    when a layer is built, not only at its first call: that call may be inside a compile, where
    registering is not allowed."""
    global _fake_registered
    if not cpu_kernels.available():
        return False
    if not _fake_registered:
        torch.library.register_fake("splitserve_cpu::linear_wq")(
            lambda rows, codes, scales, offsets, bits, group_size: rows.new_empty((rows.shape[0], codes.shape[0])))
        _fake_registered = True
    return True


_fake_registered = False


def check_group_size(group_size: int, in_features: int) -> None:
    """The kernels walk the input channels 32 at a time, each 16 with a scale of their own."""
    if group_size <= 0 or group_size % 16 or in_features % group_size or in_features % 32:
        raise ValueError(f"group size {group_size} is not supported for {in_features} input channels "
                         "(it must be a multiple of 16 that divides them, and they a multiple of 32)")


def check_groups(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, bits: int,
                 group_size: int, in_features: int) -> None:
    """A clear error for codes this form cannot hold (a format's tensors that do not fit)."""
    if bits not in BITS:
        raise ValueError(f"{bits}-bit weights are not supported (this engine reads {BITS} bits)")
    check_group_size(group_size, in_features)
    width = in_features // 2 if bits == 4 else in_features
    if codes.dim() != 2 or codes.shape[1] != width:
        raise ValueError(f"{bits}-bit codes of {in_features} input channels must be [out, {width}], "
                         f"got {tuple(codes.shape)}")
    groups = (codes.shape[0], in_features // group_size)
    for name, t in (("scales", scales), ("offsets", offsets)):
        if t is not None and tuple(t.shape) != groups:
            raise ValueError(f"{name} must be {list(groups)} for these codes, got {tuple(t.shape)}")


class GroupQuantizedLinear(torch.nn.Module):
    """A linear layer whose weight is group-wise 4/8-bit codes (see the module docstring).

    ``input_order``, when given, is a permutation of the input channels applied to the activations
    first: a GPTQ checkpoint quantized in activation order stores its groups that way."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, *, bits: int,
                 group_size: int, in_features: int, bias: torch.Tensor | None = None,
                 input_order: torch.Tensor | None = None, fmt: str = ""):
        super().__init__()
        check_groups(codes, scales, offsets, bits, group_size, in_features)
        self.in_features, self.out_features = in_features, codes.shape[0]
        self.bits, self.group_size, self.fmt = bits, group_size, fmt
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("offsets", None if offsets is None else offsets.float().contiguous())
        self.register_buffer("bias", bias)
        self.register_buffer("input_order", input_order)
        _register_cpu_kernel()
        # fp8 codes with one scale per channel can run on a Hopper-class GPU's fp8 tensor cores.
        self.per_channel_fp8 = codes.dtype == torch.float8_e4m3fn and scales.shape[1] == 1 and offsets is None

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] in the checkpoint's input order (what a reference model is given)."""
        weight = dequantize(self.codes, self.scales, self.offsets, self.bits, self.group_size)
        if self.input_order is None:
            return weight
        restored = torch.empty_like(weight)
        restored[:, self.input_order] = weight
        return restored

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.input_order is not None:
            rows = rows.index_select(1, self.input_order)
        # The kernel for where the codes are now (a model is built on the host, then moved).
        op = _grouped_op(self.codes.device)
        if self.per_channel_fp8 and rows.dtype == torch.bfloat16 and self.codes.is_cuda:
            from splitserve.engine.quantization.triton_grouped import fp8_rowwise_supported, fp8_scaled_mm
            if fp8_rowwise_supported(self.codes.device):  # activations quantized per row (vLLM's fp8 path)
                op = (lambda rows, codes, scales, offsets, bits, group: fp8_scaled_mm(rows, codes, scales))
        if op is not None:
            out = op(rows, self.codes, self.scales, self.offsets, self.bits, self.group_size)
        else:
            weight = dequantize(self.codes, self.scales, self.offsets, self.bits, self.group_size)
            out = torch.nn.functional.linear(rows, weight.to(rows.dtype))
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def narrowed(self, dim: int, rank: int, world: int, keep_bias: bool) -> GroupQuantizedLinear:
        """Rank ``rank``'s share of ``world`` for tensor parallelism: output channels (dim 0, with
        their scales and bias) or input channels (dim 1: whole groups, so each rank's scales are
        the ones its codes were quantized with; the bias left to the caller unless ``keep_bias``)."""
        if dim == 0:
            size = self.out_features // world
            rows = slice(rank * size, (rank + 1) * size)
            pick = (lambda t: None if t is None else t[rows].clone())
            return GroupQuantizedLinear(pick(self.codes), pick(self.scales), pick(self.offsets), bits=self.bits,
                                        group_size=self.group_size, in_features=self.in_features,
                                        bias=pick(self.bias) if keep_bias else None,
                                        input_order=self.input_order, fmt=self.fmt)
        size = self.in_features // world
        if size % self.group_size or self.input_order is not None:
            why = ("its input channels are in activation order" if self.input_order is not None
                   else f"{size} input channels a rank is not a whole number of its groups of {self.group_size}")
            raise ValueError(f"this quantized layer cannot be split over {world} ranks by its inputs: {why}")
        width = size // 2 if self.bits == 4 else size
        groups = slice(rank * size // self.group_size, (rank + 1) * size // self.group_size)
        return GroupQuantizedLinear(self.codes[:, rank * width:(rank + 1) * width].clone(), self.scales[:, groups].clone(),
                                    None if self.offsets is None else self.offsets[:, groups].clone(), bits=self.bits,
                                    group_size=self.group_size, in_features=size,
                                    bias=self.bias if keep_bias else None, fmt=self.fmt)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets) if t is not None)

    def extra_repr(self) -> str:
        fmt = f"{self.fmt}: " if self.fmt else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, {fmt}{self.bits}-bit, "
                f"groups of {self.group_size}")


class GroupQuantizedEmbedding(torch.nn.Module):
    """An embedding table kept as group-wise codes (GGUF's token_embd in Q8_0 or Q4_x): the looked-up
    rows are de-quantized, in the model's dtype. A tied output projection shares its tensors."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, *, bits: int,
                 group_size: int, embedding_dim: int, dtype: torch.dtype, padding_idx: int | None = None,
                 embed_scale: torch.Tensor | float | None = None):
        super().__init__()
        check_groups(codes, scales, offsets, bits, group_size, embedding_dim)
        self.num_embeddings, self.embedding_dim = codes.shape[0], embedding_dim
        self.bits, self.group_size, self.dtype, self.padding_idx = bits, group_size, dtype, padding_idx
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("offsets", None if offsets is None else offsets.float().contiguous())
        # Gemma's embeddings multiply the looked-up rows by sqrt(hidden size), in the model's dtype.
        self.embed_scale = embed_scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        offsets = None if self.offsets is None else self.offsets[flat]
        rows = dequantize(self.codes[flat], self.scales[flat], offsets, self.bits, self.group_size)
        rows = rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)
        if self.embed_scale is None:
            return rows
        return rows * torch.as_tensor(self.embed_scale).to(device=rows.device, dtype=self.dtype)

    def as_linear(self) -> GroupQuantizedLinear:
        """The tied output projection: the same codes read as a [vocab, hidden] weight."""
        return GroupQuantizedLinear(self.codes, self.scales, self.offsets, bits=self.bits,
                                    group_size=self.group_size, in_features=self.embedding_dim, fmt="tied")

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.bits}-bit, groups of {self.group_size}"
