"""GGUF checkpoints served as shipped (``--quantization gguf``): Q4_0, Q4_1 and Q8_0 tensors stay in
their codes (:mod:`.grouped`), float tensors are loaded as floats.

Tensor names are mapped to the model's with ``transformers``' own GGUF tables, and each tensor
goes through the same per-architecture processor ``transformers`` applies when it de-quantizes
a GGUF (llama.cpp stores the q/k rows of Llama-style models permuted for its rotary layout; Gemma
stores its norms minus one). For a quantized tensor the processor is given the row numbers, and
the rows of codes are reordered as it reorders them: a processor that does anything but reorder
rows is refused for quantized tensors. Other GGUF types (the K-quants, IQ*) are refused by name.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from splitserve.engine.quantization.grouped import QuantizedTensor

# GGUF block types kept quantized: (bits, bytes before the codes in a 32-weight block).
BLOCK_TYPES = {"Q4_0": (4, 2), "Q4_1": (4, 4), "Q8_0": (8, 2)}
FLOAT_TYPES = ("F32", "F16", "BF16")
GROUP = 32  # weights per GGUF block of these types


def find_gguf_file(model_dir: Path) -> Path:
    """The one ``.gguf`` file of a model directory."""
    files = sorted(model_dir.glob("*.gguf"))
    if len(files) != 1:
        found = ", ".join(f.name for f in files) or "none"
        raise ValueError(f"--quantization gguf needs exactly one .gguf file in {model_dir} (found: {found}); "
                         "the directory also holds the model's config.json and tokenizer")
    return files[0]


def blocks_to_groups(data: np.ndarray, gguf_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A GGUF row-major block array [out, blocks * block_bytes] -> codes, scales, offsets."""
    bits, header = BLOCK_TYPES[gguf_type]
    rows = data.shape[0]
    code_bytes = GROUP // 2 if bits == 4 else GROUP
    blocks = np.ascontiguousarray(data).reshape(rows, -1, header + code_bytes)
    d = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    codes = torch.from_numpy(blocks[:, :, header:].reshape(rows, -1).copy())
    if gguf_type == "Q8_0":
        return codes.view(torch.int8), d, None
    if gguf_type == "Q4_0":  # w = d (q - 8)
        return codes, d, -8.0 * d
    m = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    return codes, d, m  # Q4_1: w = d q + m


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
        quantized.append(QuantizedTensor(name, codes, scales, offsets, bits=BLOCK_TYPES[gguf_type][0],
                                         group_size=GROUP, fmt=f"GGUF {gguf_type}"))
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
