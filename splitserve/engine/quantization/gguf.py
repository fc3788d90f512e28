"""GGUF checkpoints served as shipped (``--quantization gguf``): Q4_0, Q4_1, Q8_0, Q4_K and Q6_K
tensors stay in their codes (:mod:`.grouped`; Q4_K_M files are Q4_K and Q6_K), float tensors are
loaded as floats.

Tensor names are mapped to the model's with ``transformers``' own GGUF tables, and each tensor
goes through the same per-architecture processor ``transformers`` applies when it de-quantizes
a GGUF (llama.cpp stores the q/k rows of Llama-style models permuted for its rotary layout; Gemma
stores its norms minus one). For a quantized tensor the processor is given the row numbers, and
the rows of codes are reordered as it reorders them: a processor that does anything but reorder
rows is refused for quantized tensors. Other GGUF types (Q5_K, Q2_K, Q3_K, IQ*, ...) are refused by name.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from splitserve.engine.quantization.grouped import QuantizedTensor, pack_nibbles

# GGUF block types kept quantized, and the width of their codes here and of their groups:
# the legacy 32-weight blocks, and the K-quants' 256-weight super-blocks (Q4_K: 8 sub-blocks of
# 32 with 6-bit scales and mins; Q6_K: 6-bit codes, held as 8-bit ones, in 16 sub-blocks of 16).
BLOCK_TYPES = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q8_0": (8, 32), "Q4_K": (4, 32), "Q6_K": (8, 16)}
FLOAT_TYPES = ("F32", "F16", "BF16")
GROUP = 32  # weights per legacy block
SUPER = 256  # weights per K-quant super-block


def find_gguf_file(model_dir: Path) -> Path:
    """The one ``.gguf`` file of a model directory."""
    files = sorted(model_dir.glob("*.gguf"))
    if len(files) != 1:
        found = ", ".join(f.name for f in files) or "none"
        raise ValueError(f"--quantization gguf needs exactly one .gguf file in {model_dir} (found: {found}); "
                         "the directory also holds the model's config.json and tokenizer")
    return files[0]


def _fp16(raw: np.ndarray) -> torch.Tensor:
    """[..., 2] bytes -> float32 [...] (their fp16 values, exactly)."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def blocks_to_groups(data: np.ndarray, gguf_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A GGUF row-major block array [out, blocks * block_bytes] -> codes, scales, offsets, such that
    code * scale + offset is, bit for bit, the weight ``gguf.dequantize`` computes."""
    rows = data.shape[0]
    if gguf_type in ("Q4_K", "Q6_K"):
        return _k_quant_groups(np.ascontiguousarray(data).reshape(rows, -1), gguf_type)
    code_bytes = GROUP // 2 if gguf_type != "Q8_0" else GROUP
    header = 4 if gguf_type == "Q4_1" else 2
    blocks = np.ascontiguousarray(data).reshape(rows, -1, header + code_bytes)
    d = _fp16(blocks[:, :, 0:2])
    codes = torch.from_numpy(blocks[:, :, header:].reshape(rows, -1).copy())
    if gguf_type == "Q8_0":
        return codes.view(torch.int8), d, None
    if gguf_type == "Q4_0":  # w = d (q - 8)
        return codes, d, -8.0 * d
    return codes, d, _fp16(blocks[:, :, 2:4])  # Q4_1: w = d q + m


def _k_quant_groups(data: np.ndarray, gguf_type: str):
    """Q4_K and Q6_K super-blocks, laid out as gguf's own de-quantizer reads them."""
    import gguf

    rows = data.shape[0]
    if gguf_type == "Q4_K":  # d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 bytes of codes
        blocks = data.reshape(rows, -1, 144)
        d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
        sc, mins = gguf.quants.Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
        sc = torch.from_numpy(sc.astype(np.float32)).reshape(rows, -1, 8)
        mins = torch.from_numpy(mins.astype(np.float32)).reshape(rows, -1, 8)
        # Each 64 weights: 32 bytes, low nibbles the first 32, high nibbles the next 32.
        qs = torch.from_numpy(blocks[..., 16:].copy()).reshape(rows, -1, 4, 1, 32)
        codes = torch.cat([qs & 0xF, qs >> 4], dim=3).reshape(rows, -1)
        scales = (d[..., None] * sc).reshape(rows, -1)  # w = (d sc) q - (dmin m)
        return pack_nibbles(codes), scales, -(dmin[..., None] * mins).reshape(rows, -1)
    # Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, d (fp16); w = (d sc) (q - 32).
    blocks = data.reshape(rows, -1, 210)
    ql = torch.from_numpy(blocks[..., :128].copy()).reshape(rows, -1, 2, 1, 64)
    ql = torch.cat([ql & 0xF, ql >> 4], dim=3).reshape(rows, -1, 2, 4, 32)
    qh = torch.from_numpy(blocks[..., 128:192].copy()).reshape(rows, -1, 2, 1, 32)
    qh = torch.cat([(qh >> shift) & 0x3 for shift in (0, 2, 4, 6)], dim=3)
    codes = ((ql | (qh << 4)).to(torch.int16) - 32).to(torch.int8).reshape(rows, -1)
    sc = torch.from_numpy(blocks[..., 192:208].copy().view(np.int8).astype(np.float32))
    d = _fp16(blocks[..., 208:210])
    return codes, (d[..., None] * sc).reshape(rows, -1), None


def read_gguf(path: Path, model: torch.nn.Module) -> tuple[list[QuantizedTensor], dict[str, torch.Tensor]]:
    """The tensors of ``path`` under ``model``'s names (``model`` may be on the meta device): the
    quantized ones, and the float ones by name."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    from splitserve.engine.gguf_wheel import cached_gguf_name_map

    reader = gguf.GGUFReader(str(path))
    # The processor of the file's architecture, as transformers picks it (Mistral ships as "llama").
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else model.config.model_type
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    with cached_gguf_name_map():
        names = get_gguf_hf_weights_map(model, processor)
    quantized, floats = [], {}
    for tensor in reader.tensors:
        gguf_type = tensor.tensor_type.name
        if tensor.name not in names:
            raise ValueError(f"{path.name}: tensor {tensor.name!r} has no place in {type(model).__name__}")
        name = names[tensor.name]
        if gguf_type in FLOAT_TYPES:
            data = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            data = data.reshape([int(s) for s in reversed(tensor.shape)])
            processed = processor.process(weights=data, name=tensor.name)
            floats[name] = torch.from_numpy(np.ascontiguousarray(processed.weights))
            continue
        if gguf_type not in BLOCK_TYPES:
            raise ValueError(f"{path.name}: tensor {tensor.name!r} is {gguf_type}; this engine serves GGUF "
                             f"{', '.join(BLOCK_TYPES)} and float tensors quantized as shipped")
        codes, scales, offsets = blocks_to_groups(tensor.data, gguf_type)
        order = _row_order(processor, tensor.name, codes.shape[0])
        if order is not None:
            codes, scales = codes[order], scales[order]
            offsets = None if offsets is None else offsets[order]
        bits, group = BLOCK_TYPES[gguf_type]
        quantized.append(QuantizedTensor(name, codes, scales, offsets, bits=bits, group_size=group,
                                         fmt=f"GGUF {gguf_type}"))
    return quantized, floats


def _row_order(processor, gguf_name: str, rows: int) -> torch.Tensor | None:
    """How ``processor`` reorders the rows of this tensor (None: it leaves them alone)."""
    numbers = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    moved = np.asarray(processor.process(weights=numbers, name=gguf_name).weights)
    if moved.shape != numbers.shape or sorted(moved[:, 0].tolist()) != list(range(rows)):
        raise ValueError(f"tensor {gguf_name!r}: transformers changes its values on load, which this engine "
                         "cannot do to quantized codes")
    order = torch.from_numpy(np.ascontiguousarray(moved[:, 0]))
    return None if torch.equal(order, torch.arange(rows)) else order
