"""A LoRA adapter in PEFT's format, read for the model it is meant for.

PEFT writes ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``...)
and ``adapter_model.safetensors`` whose keys are the model's module paths under
``base_model.model.``, each with a ``lora_A.weight`` ([r, in]) and a ``lora_B.weight`` ([out, r]).
The update a module adds is ``scaling * B @ A @ x``, with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with rsLoRA).

What PEFT can write but this server does not serve is refused by name, never half applied: DoRA,
per-module rank or alpha patterns, trained biases, ``modules_to_save`` (whole replaced modules),
embeddings, and a module the model has no wrapped projection for.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: Path
    rank: int  # the largest rank of its modules
    # Module path in the model (``model.layers.0.self_attn.q_proj``) -> (A [r, in], B * scaling [out, r]).
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_adapter(name: str, path: str | Path, max_rank: int) -> LoRAAdapter:
    """Read ``path`` (a PEFT adapter directory); ValueError naming what is wrong."""
    path = Path(path)
    config_path, weights_path = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no adapter_config.json in {path}")
    if not weights_path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {path} (PEFT's "
                         "save_pretrained writes it; .bin adapters are not read)")
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, refused in (("use_dora", "DoRA"), ("rank_pattern", "per-module ranks"),
                         ("alpha_pattern", "per-module alphas"), ("modules_to_save", "modules_to_save")):
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {refused} ({key}) is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: trained biases (bias={config['bias']!r}) are not supported")
    r = int(config["r"])
    alpha = float(config.get("lora_alpha", r))
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r

    from safetensors.torch import load_file
    tensors = load_file(str(weights_path))
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        body = key.removeprefix(PREFIX)
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in body:
                module, _, rest = body.partition(marker)
                if rest not in ("weight", "default.weight"):
                    raise ValueError(f"LoRA adapter {name!r}: unexpected tensor {key}")
                modules.setdefault(module, {})[part] = tensor
                break
        else:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key} is not a LoRA A or B matrix (embeddings and "
                             "other trained modules are not supported)")
    weights, rank = {}, 0
    for module, pair in modules.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {name!r}: {module} lacks its {({'lora_A', 'lora_B'} - set(pair)).pop()}")
        a, b = pair["lora_A"].float(), pair["lora_B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"LoRA adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                             "not [r, in] and [out, r]")
        rank = max(rank, a.shape[0])
        weights[module] = (a, b * scaling)
    if not weights:
        raise ValueError(f"LoRA adapter {name!r}: no LoRA weights in {weights_path}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {rank} is above this server's --max-lora-rank ({max_rank})")
    return LoRAAdapter(name, path, rank, weights)
