"""Loading a quantized checkpoint: the model is built with its parameters on the meta device (no
memory), the checkpoint's quantized tensors become quantized modules as they are read, its float
tensors fill the parameters left, and nothing is ever held as a float copy of a quantized weight.

A float checkpoint quantized at load (``--quantization int8`` / ``fp8``) goes the same way: each
linear's weight is quantized as it is read, so the float model never exists whole.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from splitserve.common.malloc import return_free_pages
from splitserve.engine.config import CHECKPOINT_QUANTIZATIONS
from splitserve.engine.quantization.grouped import GroupQuantizedEmbedding, GroupQuantizedLinear, QuantizedTensor
from splitserve.engine.quantization.per_channel import (QUANTIZES_OUTPUT_PROJECTION, QuantizedLinear, QuantizedWeights,
                                                        linears_to_quantize)

log = logging.getLogger(__name__)


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


def read_safetensors_checkpoint(model_dir: Path, method: str, config: dict, model: torch.nn.Module):
    """A checkpoint's quantized linears in grouped form, and its other tensors as floats, by the
    names of ``model`` (empty: only its names are read)."""
    read, parts, markers = _readers()[method]
    tensors = dict(_iter_safetensors(model_dir, key_namer(model)))
    modules = sorted({key.rsplit(".", 1)[0] for key in tensors if key.rsplit(".", 1)[-1] in markers})
    quantized = []
    for module in modules:
        mine = {part: tensors.pop(f"{module}.{part}") for part in parts if f"{module}.{part}" in tensors}
        quantized.append(read(module, mine, config))
    ignored = [key for key in tensors if key.endswith(IGNORED_SUFFIXES)]
    if ignored:
        log.info("%s: %d activation/KV scales not used (weights only are quantized here)", method, len(ignored))
    return quantized, {key: t for key, t in tensors.items() if key not in ignored}


class NeedsConversion(ValueError):
    """A checkpoint key that transformers converts on load (not only renames): per-expert MoE weights
    stacked into one tensor, fused projections split, ... This reader does not do those."""


def key_namer(model: torch.nn.Module):
    """checkpoint key -> the model's parameter name, by transformers' own renamings for this
    architecture (legacy names such as GPT-NeoX's ``embed_out``); ``NeedsConversion`` for a key one
    of its converters would transform."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)

    def name(key: str) -> str:
        renamed, converted = rename_source_key(key, renamings, converters, prefix, meta)
        if converted is not None:
            raise NeedsConversion(f"checkpoint tensor {key!r} is converted by transformers on load "
                                  f"({converted}), which this reader does not do")
        return renamed
    return name


def _iter_safetensors(model_dir: Path, name=lambda key: key):
    """(the model's name, tensor) of every tensor of the checkpoint, one at a time. The file is
    mapped for one tensor at a time: mapped for the whole read, every page read would stay
    resident until the end (the peak RSS of a bf16 int8 load measured 1,858 MiB that way)."""
    from safetensors import safe_open
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
        for key in keys:
            with safe_open(str(path), framework="pt") as f:
                tensor = f.get_tensor(key)
            yield name(key), tensor


def load_quantizing(model_dir: Path, method: str, dtype: torch.dtype, device: torch.device,
                    attn_implementation: str) -> tuple[torch.nn.Module, QuantizedWeights]:
    """A float checkpoint with every linear layer quantized (``int8``/``fp8``, per channel) as its
    weight is read, in ``dtype`` first (what quantizing the loaded model would see); the output
    projection as well where ``QUANTIZES_OUTPUT_PROJECTION`` says so."""
    model = empty_model(model_dir, dtype, attn_implementation)
    linears = {name for name, _ in linears_to_quantize(model, method)}
    floats: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedLinear] = {}
    before = 0
    for key, tensor in _iter_safetensors(model_dir, key_namer(model)):
        module_name = key.removesuffix(".weight")
        if module_name not in linears or not key.endswith(".weight"):
            # A copy: a view would keep the whole checkpoint file mapped (and its pages resident).
            floats[key] = tensor.to(dtype, copy=True)
            continue
        module = model.get_submodule(module_name)
        weight = tensor.to(dtype)
        quantized[module_name] = _quantized(module, weight, method)
        before += weight.numel() * weight.element_size()
    for name, layer in quantized.items():
        bias = floats.pop(f"{name}.bias", None)
        layer.bias = None if bias is None else bias.to(dtype)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
    install(model, [], floats, dtype)
    # A tied output projection, absent from the checkpoint, is quantized from the embedding's table.
    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear and QUANTIZES_OUTPUT_PROJECTION[method]:
        before += head.weight.numel() * head.weight.element_size()
        quantized["lm_head"] = _quantized(head, head.weight, method)
        model.set_output_embeddings(quantized["lm_head"])
    after = sum(q.codes.numel() + q.scales.numel() * 4 for q in quantized.values())
    return_free_pages()  # the float weights freed while quantizing (the process measured 390 MiB larger)
    log.info("quantized %d linear layers to %s while loading: %.1f -> %.1f MiB of weights", len(quantized), method,
             before / 2**20, after / 2**20)
    model.eval()
    model.requires_grad_(False)
    return model.to(device), QuantizedWeights(len(quantized), before, after)


def _quantized(module: torch.nn.Linear, weight: torch.Tensor, method: str) -> QuantizedLinear:
    """``module`` (its shape; maybe on the meta device) with ``weight``, quantized per channel."""
    dense = torch.nn.Linear(module.in_features, module.out_features, bias=False, device="meta")
    dense.weight = torch.nn.Parameter(weight, requires_grad=False)
    return QuantizedLinear(dense, method)


def load_quantized_model(model_dir: Path, method: str, dtype: torch.dtype, device: torch.device,
                         attn_implementation: str) -> torch.nn.Module:
    """The model of ``model_dir`` with its ``method``-format weights kept quantized."""
    model = empty_model(model_dir, dtype, attn_implementation)
    if method == "gguf":
        from splitserve.engine.quantization.gguf import find_gguf_file, read_gguf
        quantized, floats = read_gguf(find_gguf_file(model_dir), model)
    elif method in _readers():
        quantized, floats = read_safetensors_checkpoint(model_dir, method, quantization_config(model.config), model)
    else:
        raise ValueError(f"quantization={method!r} is not a checkpoint format this engine reads "
                         f"({', '.join(CHECKPOINT_QUANTIZATIONS)})")
    weight_bytes = install(model, quantized, floats, dtype)
    log.info("%s: %d quantized weights (%.1f MiB) and %d float tensors", method, len(quantized),
             weight_bytes / 2**20, len(floats))
    model.eval()
    model.requires_grad_(False)
    return model.to(device)
