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

With the Triton kernels (``GroupedRows``: the CUDA default, or ``--attention-backend triton``) each
token multiplies by its own adapter's A and B only: the step's tokens sorted by slot, the shrink
and the expand each one grouped-GEMM launch over the slots (``splitserve.engine.experts.triton_gemm``,
a slot for an expert, vLLM's segmented LoRA GEMMs), the base model's tokens in no tile (their
update is exactly 0).
"""
from __future__ import annotations

import torch

# The projections of a decoder layer that adapters may target (Llama, Mistral, Qwen, Gemma and
# most causal LMs in transformers use these names).
TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


class GroupedRows:
    """A step's tokens sorted by adapter slot and the tiles over them, for the grouped-GEMM path;
    written each step by ``LoRAManager.prepare_step``, shared by every wrapped layer. Fixed-size
    buffers (a compiled graph and a CUDA graph see the same tensors every step)."""

    def __init__(self, max_tokens: int, max_loras: int, device: torch.device):
        from splitserve.engine.experts.triton_gemm import BLOCK_M
        self.block_m, self.max_loras = BLOCK_M, max_loras
        max_tiles = -(-max_tokens // BLOCK_M) + max_loras
        # Token index of each sorted row: the adapters' tokens by slot, then the base model's.
        self.order = torch.arange(max_tokens, dtype=torch.int32, device=device)
        # Per tile: its slot (max_loras: an unused tile), its first row and the end of its slot's rows.
        self.tile_slot = torch.full((max_tiles,), max_loras, dtype=torch.int32, device=device)
        self.tile_start = torch.zeros(max_tiles, dtype=torch.int32, device=device)
        self.tile_end = torch.zeros(max_tiles, dtype=torch.int32, device=device)

    def write(self, slot_of_token: list[int | None]) -> None:
        by_slot = sorted((t for t, s in enumerate(slot_of_token) if s is not None), key=lambda t: slot_of_token[t])
        rest = [t for t, s in enumerate(slot_of_token) if s is None]
        slots, starts, ends = [], [], []
        first = 0
        while first < len(by_slot):
            slot = slot_of_token[by_slot[first]]
            end = first
            while end < len(by_slot) and slot_of_token[by_slot[end]] == slot:
                end += 1
            for start in range(first, end, self.block_m):
                slots.append(slot), starts.append(start), ends.append(end)
            first = end
        n, k = len(slot_of_token), len(slots)
        self.order[:n].copy_(torch.tensor(by_slot + rest, dtype=torch.int32))
        self.tile_slot.fill_(self.max_loras)
        if k:
            self.tile_slot[:k].copy_(torch.tensor(slots, dtype=torch.int32))
            self.tile_start[:k].copy_(torch.tensor(starts, dtype=torch.int32))
            self.tile_end[:k].copy_(torch.tensor(ends, dtype=torch.int32))


class LoRALinear(torch.nn.Module):
    def __init__(self, base: torch.nn.Module, in_features: int, out_features: int, mask: torch.Tensor,
                 grouped: GroupedRows | None = None):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = in_features, out_features
        rows = mask.shape[1]
        self.register_buffer("lora_a", torch.zeros(rows, in_features, dtype=mask.dtype, device=mask.device))
        self.register_buffer("lora_b", torch.zeros(out_features, rows, dtype=mask.dtype, device=mask.device))
        self.register_buffer("lora_mask", mask, persistent=False)  # the engine's, shared
        self.grouped = grouped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        flat = x.reshape(-1, self.in_features)
        if self.grouped is not None:
            return y + self._grouped_update(flat).view(y.shape)
        shrunk = (flat @ self.lora_a.t()) * self.lora_mask[:flat.shape[0]]
        return y + (shrunk @ self.lora_b.t()).view(y.shape)

    def _grouped_update(self, flat: torch.Tensor) -> torch.Tensor:
        g = self.grouped
        n, slots = flat.shape[0], g.max_loras
        rank = self.lora_a.shape[0] // slots
        used = -(-n // g.block_m) + slots  # the most tiles n tokens can take: launch no more programs
        tiles = (g.tile_slot[:used], g.tile_start[:used], g.tile_end[:used])
        order = g.order[:n]
        a = self.lora_a.view(slots, rank, self.in_features)  # [slot, R, in]
        b = self.lora_b.view(self.out_features, slots, rank).permute(1, 0, 2)  # [slot, out, R]
        shrunk = torch.ops.splitserve.moe_grouped_gemm(flat, order, a, None, *tiles, n, False)
        expanded = torch.ops.splitserve.moe_grouped_gemm(shrunk, None, b, None, *tiles, n, False, True)
        return torch.empty_like(expanded).index_copy_(0, order.to(torch.int64), expanded).to(flat.dtype)


def wrap_projections(model: torch.nn.Module, mask: torch.Tensor,
                     grouped: GroupedRows | None = None) -> dict[str, LoRALinear]:
    """Replace every ``TARGETS`` projection of ``model`` by a ``LoRALinear`` around it; returns
    them by module path (``model.layers.0.self_attn.q_proj``: PEFT's key, less its prefix)."""
    found = [(name, module) for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in TARGETS]
    wrapped = {}
    for name, module in found:
        in_features, out_features = _features(name, module)
        parent_name, _, child = name.rpartition(".")
        layer = LoRALinear(module, in_features, out_features, mask, grouped)
        setattr(model.get_submodule(parent_name), child, layer)
        wrapped[name] = layer
    if not wrapped:
        raise ValueError(f"LoRA: this model has none of the projections adapters target ({', '.join(sorted(TARGETS))})")
    return wrapped


def _features(name: str, module: torch.nn.Module) -> tuple[int, int]:
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return module.in_features, module.out_features
    raise ValueError(f"LoRA: {name} ({type(module).__name__}) does not say its in_features and out_features")
