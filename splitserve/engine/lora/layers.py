"""``LoRALinear``: a projection of the model plus the low-rank updates of its adapters.

Every adapter slot has ``max_rank`` rows in the stacked matrices: ``lora_a`` [slots * R, in]
holds each resident adapter's A in its slot's rows (zeros past its rank), ``lora_b``
[out, slots * R] its B, already scaled. One step computes, for all its tokens at once,

    y = base(x) + ((x @ lora_a.T) * mask) @ lora_b.T

where ``mask`` [tokens, slots * R] (one per engine, shared by every wrapped layer, written each
step by ``LoRAManager.prepare_step``) is 1 on the columns of the token's own adapter and 0
elsewhere: tokens of different adapters, and of the base model (a row of zeros: its update is
exactly 0), share the step and its two dense matmuls, with no loop over adapters or requests and
one compiled graph for every mix. What it costs grows with ``max_loras * max_lora_rank``, not with
how many adapters a step holds (docs/performance.md measures it).
"""
from __future__ import annotations

import torch

# The projections of a decoder layer that adapters may target (Llama, Mistral, Qwen, Gemma and
# most causal LMs in transformers use these names).
TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


class LoRALinear(torch.nn.Module):
    def __init__(self, base: torch.nn.Module, in_features: int, out_features: int, mask: torch.Tensor):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = in_features, out_features
        rows = mask.shape[1]
        self.register_buffer("lora_a", torch.zeros(rows, in_features, dtype=mask.dtype, device=mask.device))
        self.register_buffer("lora_b", torch.zeros(out_features, rows, dtype=mask.dtype, device=mask.device))
        self.register_buffer("lora_mask", mask, persistent=False)  # the engine's, shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        flat = x.reshape(-1, self.in_features)
        shrunk = (flat @ self.lora_a.t()) * self.lora_mask[:flat.shape[0]]
        return y + (shrunk @ self.lora_b.t()).view(y.shape)


def wrap_projections(model: torch.nn.Module, mask: torch.Tensor) -> dict[str, LoRALinear]:
    """Replace every ``TARGETS`` projection of ``model`` by a ``LoRALinear`` around it; returns
    them by module path (``model.layers.0.self_attn.q_proj``: PEFT's key, less its prefix)."""
    found = [(name, module) for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in TARGETS]
    wrapped = {}
    for name, module in found:
        in_features, out_features = _features(name, module)
        parent_name, _, child = name.rpartition(".")
        layer = LoRALinear(module, in_features, out_features, mask)
        setattr(model.get_submodule(parent_name), child, layer)
        wrapped[name] = layer
    if not wrapped:
        raise ValueError(f"LoRA: this model has none of the projections adapters target ({', '.join(sorted(TARGETS))})")
    return wrapped


def _features(name: str, module: torch.nn.Module) -> tuple[int, int]:
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return module.in_features, module.out_features
    raise ValueError(f"LoRA: {name} ({type(module).__name__}) does not say its in_features and out_features")
