"""Loading a quantized checkpoint: the model is built with its parameters on the meta device (no
memory), the checkpoint's quantized tensors become quantized modules as they are read, its float
tensors fill the parameters left, and nothing is ever held as a float copy of a quantized weight.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from splitserve.engine.quantization.grouped import GroupQuantizedEmbedding, GroupQuantizedLinear, QuantizedTensor

log = logging.getLogger(__name__)

from splitserve.engine.config import CHECKPOINT_QUANTIZATIONS


def empty_model(model_dir: Path, dtype: torch.dtype, attn_implementation: str) -> torch.nn.Module:
    """The model of ``model_dir``'s config with every parameter on the meta device (buffers such as
    rotary frequencies are real: they are computed, not loaded)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)


def _set_tensor(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    if attr in parent._parameters:
        parent._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
    elif attr in parent._buffers:
        parent._buffers[attr] = value
    else:
        raise ValueError(f"the checkpoint's {name} is neither a parameter nor a buffer of the model")


def install(model: torch.nn.Module, quantized: list[QuantizedTensor], floats: dict[str, torch.Tensor],
            dtype: torch.dtype) -> int:
    """Put ``quantized`` (as modules) and ``floats`` (as parameters, in ``dtype``) into ``model``;
    returns the bytes of the quantized weights. Every parameter must end up filled."""
    weight_bytes = 0
    embedding = model.get_input_embeddings()
    for tensor in quantized:
        module_name = tensor.name.removesuffix(".weight")
        parent_name, _, child = module_name.rpartition(".")
        module = model.get_submodule(module_name)
        if module is embedding:
            if tensor.input_order is not None:
                raise ValueError(f"{tensor.name}: an embedding cannot have an input order")
            new = GroupQuantizedEmbedding(tensor.codes, tensor.scales, tensor.offsets, bits=tensor.bits,
                                          group_size=tensor.group_size, embedding_dim=module.embedding_dim,
                                          dtype=dtype, padding_idx=module.padding_idx,
                                          embed_scale=getattr(module, "embed_scale", None))
        elif isinstance(module, torch.nn.Linear):
            bias = floats.pop(f"{module_name}.bias", None)
            new = GroupQuantizedLinear(tensor.codes, tensor.scales, tensor.offsets, bits=tensor.bits,
                                       group_size=tensor.group_size, in_features=module.in_features,
                                       bias=None if bias is None else bias.to(dtype), input_order=tensor.input_order,
                                       fmt=tensor.fmt)
            if new.out_features != module.out_features:
                raise ValueError(f"{tensor.name} has {new.out_features} output channels where the model has "
                                 f"{module.out_features}")
        else:
            raise ValueError(f"{tensor.name} is quantized in the checkpoint, but {module_name} is a "
                             f"{type(module).__name__}, not a linear layer or the embedding")
        weight_bytes += sum(t.numel() * t.element_size() for t in (tensor.codes, tensor.scales, tensor.offsets)
                            if t is not None)
        setattr(model.get_submodule(parent_name), child, new)
    for name, value in floats.items():
        _set_tensor(model, name, value.to(dtype))
    _tie_output(model)
    empty = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if empty:
        raise ValueError(f"the checkpoint does not fill {len(empty)} of the model's tensors: "
                         + ", ".join(empty[:6]) + (" ..." if len(empty) > 6 else ""))
    return weight_bytes


def _tie_output(model: torch.nn.Module) -> None:
    """A tied output projection the checkpoint left out shares the embedding's (quantized or float) table."""
    head = model.get_output_embeddings()
    if head is None or not getattr(model.config, "tie_word_embeddings", False):
        return
    if isinstance(head, torch.nn.Linear) and not head.weight.is_meta:
        return  # the checkpoint has its own
    embedding = model.get_input_embeddings()
    if isinstance(embedding, GroupQuantizedEmbedding):
        model.set_output_embeddings(embedding.as_linear())
    else:
        head.weight = embedding.weight


def quantization_config(hf_config) -> dict:
    """The checkpoint's ``quantization_config`` as a dict (empty when it has none)."""
    found = getattr(hf_config, "quantization_config", None) or {}
    return found if isinstance(found, dict) else found.to_dict()


def safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no .safetensors files to read quantized weights from")
    return files


def _readers():
    """quant_method -> (read one linear, the tensor names of a quantized linear, the names that
    mark a linear as quantized)."""
    from splitserve.engine.quantization import compressed, gptq_awq
    return {
        "gptq": (gptq_awq.read_gptq, ("qweight", "qzeros", "scales", "g_idx"), ("qweight",)),
        "awq": (gptq_awq.read_awq, ("qweight", "qzeros", "scales"), ("qweight",)),
        "fp8": (compressed.read_fp8, compressed.PARTS, ("weight_scale", "weight_scale_inv")),
        "compressed-tensors": (compressed.read_compressed, compressed.PARTS, ("weight_scale",)),
    }


# Scales of what this engine keeps in its own dtype (static activation scales, fp8 KV-cache
# scales): read and set aside.
IGNORED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".q_scale")


def read_safetensors_checkpoint(model_dir: Path, method: str, config: dict):
    """A checkpoint's quantized linears in grouped form, and its other tensors as floats by name."""
    from safetensors import safe_open

    read, parts, markers = _readers()[method]
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    modules = sorted({key.rsplit(".", 1)[0] for key in tensors if key.rsplit(".", 1)[-1] in markers})
    quantized = []
    for module in modules:
        mine = {part: tensors.pop(f"{module}.{part}") for part in parts if f"{module}.{part}" in tensors}
        quantized.append(read(module, mine, config))
    ignored = [key for key in tensors if key.endswith(IGNORED_SUFFIXES)]
    if ignored:
        log.info("%s: %d activation/KV scales not used (weights only are quantized here)", method, len(ignored))
    return quantized, {key: t for key, t in tensors.items() if key not in ignored}


def load_quantized_model(model_dir: Path, method: str, dtype: torch.dtype, device: torch.device,
                         attn_implementation: str) -> torch.nn.Module:
    """The model of ``model_dir`` with its ``method``-format weights kept quantized."""
    model = empty_model(model_dir, dtype, attn_implementation)
    if method == "gguf":
        from splitserve.engine.quantization.gguf import find_gguf_file, read_gguf
        quantized, floats = read_gguf(find_gguf_file(model_dir), model)
    elif method in _readers():
        quantized, floats = read_safetensors_checkpoint(model_dir, method, quantization_config(model.config))
    else:
        raise ValueError(f"quantization={method!r} is not a checkpoint format this engine reads "
                         f"({', '.join(CHECKPOINT_QUANTIZATIONS)})")
    weight_bytes = install(model, quantized, floats, dtype)
    log.info("%s: %d quantized weights (%.1f MiB) and %d float tensors", method, len(quantized),
             weight_bytes / 2**20, len(floats))
    model.eval()
    model.requires_grad_(False)
    return model.to(device)
