"""``LoRALinear``: a projection of the model plus the low-rank updates of its adapters.

Every adapter slot has ``max_rank`` rows in the stacked matrices: ``lora_a`` [slots * R, in]
holds each resident adapter's A in its slot's rows (zeros past its rank), ``lora_b``
[slots * R, out] its B, transposed and already scaled. A step's tokens of every adapter, and of the
base model (whose update is exactly 0), share the step: each wrapped layer adds

    y = base(x) + update(x)      update(x)[t] = x[t] @ A[s].T @ B[s],  s the slot of token t

computed for all the step's tokens by one object shared by every layer and written once a step
by ``LoRAManager.prepare_step`` (no loop over adapters or requests in the graph, one compiled
graph for every mix):

* ``TokenSlots`` (CPU, where the C++ kernels built): each token's slot, and one call of
  ``splitserve_cpu::lora_update`` a layer, which runs each token through its own slot's A and B
  only (csrc/lora_cpu.cpp): the work of one adapter however many slots there are.
* ``GroupedRows`` (the Triton kernels: the CUDA default, or ``--attention-backend triton``): the
  tokens sorted by slot and the shrink and the expand each one grouped-GEMM launch over the slots
  (``splitserve.engine.experts.triton_gemm``, a slot for an expert, vLLM's segmented LoRA GEMMs),
  the base model's tokens in no tile.
* ``MaskedRows`` (the portable path: a CPU without a compiler): every token through the stack of
  all slots in two dense matmuls, ``((x @ lora_a.T) * mask) @ lora_b``, ``mask`` 1 on the columns
  of the token's slot; it costs ``max_loras`` times the work of one adapter.
"""
from __future__ import annotations

from typing import Sequence

import torch

# The projections of a decoder layer that adapters may target (Llama, Mistral, Qwen, Gemma and
# most causal LMs in transformers use these names).
TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def _runs(slot_of_token: Sequence[int | None]):
    """(slot, first token, end) of each run of consecutive tokens of one slot (None: the base model)."""
    first = 0
    while first < len(slot_of_token):
        end = first + 1
        while end < len(slot_of_token) and slot_of_token[end] == slot_of_token[first]:
            end += 1
        yield slot_of_token[first], first, end
        first = end


class TokenSlots:
    """Each token's adapter slot (-1: the base model) for the C++ kernel; fixed-size, so the
    compiled graph sees the same tensor every step."""

    def __init__(self, max_tokens: int, max_loras: int, max_rank: int, device: torch.device):
        self.rank = max_rank
        self.slot = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)

    def write(self, slot_of_token: Sequence[int | None]) -> None:
        self.slot[:len(slot_of_token)].copy_(torch.tensor([-1 if s is None else s for s in slot_of_token],
                                                          dtype=torch.int32))

    def update(self, layer: "LoRALinear", flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.splitserve_cpu.lora_update(flat, layer.lora_a, layer.lora_b, self.slot, self.rank)


class MaskedRows:
    """The mask [tokens, slots * R] of the portable path: 1 on the columns of each token's slot."""

    def __init__(self, max_tokens: int, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.rank = max_rank
        self.mask = torch.zeros(max_tokens, max_loras * max_rank, dtype=dtype, device=device)
        self._set = 0  # rows the last step set (zeroed before the next one)

    def write(self, slot_of_token: Sequence[int | None]) -> None:
        if self._set:
            self.mask[:self._set].zero_()
        self._set = 0
        for slot, first, end in _runs(slot_of_token):
            if slot is not None:
                self.mask[first:end, slot * self.rank:(slot + 1) * self.rank] = 1
                self._set = end

    def update(self, layer: "LoRALinear", flat: torch.Tensor) -> torch.Tensor:
        return ((flat @ layer.lora_a.t()) * self.mask[:flat.shape[0]]) @ layer.lora_b


class GroupedRows:
    """A step's tokens sorted by adapter slot and the tiles over them, for the grouped-GEMM path.
    Fixed-size buffers (a compiled graph and a CUDA graph see the same tensors every step)."""

    def __init__(self, max_tokens: int, max_loras: int, max_rank: int, device: torch.device):
        from splitserve.engine.experts.triton_gemm import BLOCK_M
        self.block_m, self.max_loras, self.rank = BLOCK_M, max_loras, max_rank
        max_tiles = -(-max_tokens // BLOCK_M) + max_loras
        # Token index of each sorted row: the adapters' tokens by slot, then the base model's.
        self.order = torch.arange(max_tokens, dtype=torch.int32, device=device)
        # Per tile: its slot (max_loras: an unused tile), its first row and the end of its slot's rows.
        self.tile_slot = torch.full((max_tiles,), max_loras, dtype=torch.int32, device=device)
        self.tile_start = torch.zeros(max_tiles, dtype=torch.int32, device=device)
        self.tile_end = torch.zeros(max_tiles, dtype=torch.int32, device=device)

    def write(self, slot_of_token: Sequence[int | None]) -> None:
        by_slot = sorted((t for t, s in enumerate(slot_of_token) if s is not None), key=lambda t: slot_of_token[t])
        rest = [t for t, s in enumerate(slot_of_token) if s is None]
        slots, starts, ends = [], [], []
        for slot, first, end in _runs([slot_of_token[t] for t in by_slot]):
            for start in range(first, end, self.block_m):
                slots.append(slot), starts.append(start), ends.append(end)
        n, k = len(slot_of_token), len(slots)
        self.order[:n].copy_(torch.tensor(by_slot + rest, dtype=torch.int32))
        self.tile_slot.fill_(self.max_loras)
        if k:
            self.tile_slot[:k].copy_(torch.tensor(slots, dtype=torch.int32))
            self.tile_start[:k].copy_(torch.tensor(starts, dtype=torch.int32))
            self.tile_end[:k].copy_(torch.tensor(ends, dtype=torch.int32))

    def update(self, layer: "LoRALinear", flat: torch.Tensor) -> torch.Tensor:
        n, slots, rank = flat.shape[0], self.max_loras, self.rank
        used = -(-n // self.block_m) + slots  # the most tiles n tokens can take: launch no more programs
        tiles = (self.tile_slot[:used], self.tile_start[:used], self.tile_end[:used])
        order = self.order[:n]
        a = layer.lora_a.view(slots, rank, layer.in_features)  # [slot, R, in]
        b = layer.lora_b.view(slots, rank, layer.out_features)  # [slot, R, out]
        shrunk = torch.ops.splitserve.moe_grouped_gemm(flat, order, a, None, *tiles, n, False)
        expanded = torch.ops.splitserve.moe_grouped_gemm(shrunk, None, b, None, *tiles, n, True, True)
        return torch.empty_like(expanded).index_copy_(0, order.to(torch.int64), expanded).to(flat.dtype)


StepRows = TokenSlots | MaskedRows | GroupedRows


class LoRALinear(torch.nn.Module):
    def __init__(self, base: torch.nn.Module, in_features: int, out_features: int, rows: StepRows,
                 slots: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = in_features, out_features
        stacked = slots * rows.rank
        self.register_buffer("lora_a", torch.zeros(stacked, in_features, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(stacked, out_features, dtype=dtype, device=device))
        self.rows = rows  # the engine's, shared by every layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        return y + self.rows.update(self, x.reshape(-1, self.in_features)).view(y.shape)


def wrap_projections(model: torch.nn.Module, rows: StepRows, slots: int, dtype: torch.dtype,
                     device: torch.device) -> dict[str, LoRALinear]:
    """Replace every ``TARGETS`` projection of ``model`` by a ``LoRALinear`` around it; returns
    them by module path (``model.layers.0.self_attn.q_proj``: PEFT's key, less its prefix)."""
    found = [(name, module) for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in TARGETS]
    wrapped = {}
    for name, module in found:
        in_features, out_features = _features(name, module)
        parent_name, _, child = name.rpartition(".")
        layer = LoRALinear(module, in_features, out_features, rows, slots, dtype, device)
        setattr(model.get_submodule(parent_name), child, layer)
        wrapped[name] = layer
    if not wrapped:
        raise ValueError(f"LoRA: this model has none of the projections adapters target ({', '.join(sorted(TARGETS))})")
    return wrapped


def _features(name: str, module: torch.nn.Module) -> tuple[int, int]:
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return module.in_features, module.out_features
    raise ValueError(f"LoRA: {name} ({type(module).__name__}) does not say its in_features and out_features")
