"""GPTQ and AWQ checkpoints: integer codes packed into int32 words, a zero point and a 16-bit scale per
group of input channels; ``w = scale * (code - zero)``.

* GPTQ (AutoGPTQ / GPTQModel, ``quant_method: gptq``): ``qweight`` [in / p, out] packs p = 32 / bits
  codes of consecutive input channels per word, low bits first; ``qzeros`` [groups, out / p] packs
  the zero points of consecutive output channels the same way, stored minus one in the original
  format (``checkpoint_format: gptq``, "v1") and as they are in ``gptq_v2``; ``scales`` [groups,
  out]; ``g_idx`` [in] the group of each input channel. Quantized in activation order
  (``desc_act``), ``g_idx`` is a permutation of the groups: the input channels are sorted by group
  here (each group then contiguous) and the activations are permuted the same way before the matmul.
* AWQ (AutoAWQ's GEMM layout, ``quant_method: awq``, ``version: gemm``): 4-bit; ``qweight`` [in,
  out / 8] packs 8 output channels per word in the order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds
  channel ``AWQ_ORDER[i]`` of the eight); ``qzeros`` [groups, out / 8] the same; ``scales`` [groups,
  out]; groups are consecutive input channels.

Both become :mod:`.grouped`'s form (offset = -zero * scale, exact in float32), so the weight the
kernel rebuilds is ``scale * (code - zero)`` bit for bit.
"""
from __future__ import annotations

import torch

from splitserve.engine.quantization.grouped import QuantizedTensor, check_group_size, pack_nibbles

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits codes each (low bits first), laid out along ``dim``."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:  # [rows, cols] -> [rows * per_word, cols]
        codes = (words[:, None, :] >> shifts[None, :, None]) & mask
        return codes.reshape(words.shape[0] * per_word, words.shape[1])
    codes = (words[:, :, None] >> shifts[None, None, :]) & mask  # [rows, cols * per_word]
    return codes.reshape(words.shape[0], words.shape[1] * per_word)


def _as_groups(codes_in_out: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int):
    """codes [in, out] (unsigned), zeros and scales [groups, out] -> codes, scales, offsets in the
    grouped form ([out, ...], 8-bit codes re-centred as int8)."""
    scales = scales.float().t().contiguous()
    zeros = zeros.float().t()
    codes = codes_in_out.t().contiguous()
    if bits == 4:
        return pack_nibbles(codes), scales, (-zeros * scales).contiguous()
    # code - zero == (code - 128) - (zero - 128): int8 codes, the offset moved with them.
    return (codes - 128).to(torch.int8), scales, (-(zeros - 128) * scales).contiguous()


def read_gptq(name: str, tensors: dict[str, torch.Tensor], config: dict) -> QuantizedTensor:
    """One GPTQ linear (``tensors``: its qweight, qzeros, scales and maybe g_idx) in grouped form."""
    bits = int(config.get("bits", 4))
    if bits not in (4, 8):
        raise ValueError(f"GPTQ with {bits}-bit weights is not supported (4 and 8 are)")
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    codes = unpack_words(qweight, bits, dim=0)  # [in, out]
    in_features = codes.shape[0]
    group = int(config.get("group_size", 128))
    group = in_features if group == -1 else group
    check_group_size(group, in_features)
    zeros = unpack_words(qzeros, bits, dim=1)[:, :codes.shape[1]]
    if config.get("checkpoint_format", "gptq") == "gptq":
        zeros = zeros + 1  # v1 stores zero - 1
    g_idx = tensors.get("g_idx")
    order = None
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(in_features) // group):
        # Activation order: sort the input channels by group; each group must then fill its slot.
        order = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx.long()[order], torch.arange(in_features) // group):
            raise ValueError(f"{name}: g_idx does not give each of its groups {group} input channels")
        codes = codes[order]
    codes, scales, offsets = _as_groups(codes, zeros, scales, bits)
    return QuantizedTensor(f"{name}.weight", codes, scales, offsets, bits=bits, group_size=group,
                           input_order=order, fmt=f"GPTQ{' act-order' if order is not None else ''}")


def read_awq(name: str, tensors: dict[str, torch.Tensor], config: dict) -> QuantizedTensor:
    """One AWQ (GEMM layout) linear in grouped form."""
    bits = int(config.get("bits", config.get("w_bit", 4)))
    version = str(config.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm" or not config.get("zero_point", True):
        raise ValueError(f"AWQ with bits={bits}, version={version!r}, zero_point={config.get('zero_point', True)} "
                         "is not supported (4-bit GEMM layout with zero points is)")
    group = int(config.get("group_size", config.get("q_group_size", 128)))
    reverse = torch.tensor([AWQ_ORDER.index(i) for i in range(8)])

    def unpack(words: torch.Tensor) -> torch.Tensor:
        nibbles = unpack_words(words, 4, dim=1).reshape(words.shape[0], words.shape[1], 8)
        return nibbles[:, :, reverse].reshape(words.shape[0], -1)

    codes, zeros = unpack(tensors["qweight"]), unpack(tensors["qzeros"])
    codes, scales, offsets = _as_groups(codes, zeros, tensors["scales"], 4)
    return QuantizedTensor(f"{name}.weight", codes, scales, offsets, bits=4, group_size=group, fmt="AWQ")


READERS = {"gptq": (read_gptq, ("qweight", "qzeros", "scales", "g_idx")),
           "awq": (read_awq, ("qweight", "qzeros", "scales"))}
