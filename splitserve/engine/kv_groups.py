"""How a model's layers share the KV pool when some of them attend through a sliding window.

A windowed layer only reads the last ``window`` positions, so the pages behind them can go back
to the pool as a sequence grows (Gemma 3 keeps 5 of every 6 layers' KV to 512 or 1,024 tokens) —
but only where those pages hold that layer's KV alone. So the layers are put in groups of one
attention kind (full, or one window size). Each group has a block table of its own per request
(``kv_cache_manager``), and every group holds the same number of layers (``slots``). A page id
then means the same memory in every group, all groups draw pages from one pool, and the pool is
``[slots, 2, blocks, ...]``: layer ``l`` lies at slot ``place[l][1]`` of the pages of group
``place[l][0]``. This is the layout of vLLM's hybrid KV cache manager.

A model whose layers all attend alike has one group of all its layers (``slots`` = layers): the
layout the engine has always had. Its pages are freed behind the window if every layer is
windowed (Mistral), and never otherwise.

No torch here: the cache manager and the sizing CLI use it without a model.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    # Window of each group's layers (0: full attention), full-attention groups first.
    windows: tuple[int, ...]
    # Layers per page: the first dimension of the pool.
    slots: int
    # (group, slot) of each layer, by layer index.
    place: tuple[tuple[int, int], ...]

    @property
    def frees_pages(self) -> bool:
        """Whether any group gives pages back as sequences grow past its window."""
        return any(self.windows)

    @property
    def padded_slots(self) -> int:
        """Slots no layer uses (the last group of a kind may be short): memory paid for nothing."""
        return len(self.windows) * self.slots - len(self.place)

    def layers_of(self, group: int) -> list[int]:
        return [layer for layer, (g, _) in enumerate(self.place) if g == group]


def one_group(num_layers: int) -> KVGroups:
    """Every layer in one group that keeps every page (the windows, if any, applied by the kernels)."""
    return KVGroups((0,), num_layers, tuple((0, layer) for layer in range(num_layers)))


def layer_windows(hf_config) -> list[int]:
    """The sliding window of each layer as ``transformers`` applies it (0: full attention).

    Models with windowed and full layers list them in ``layer_types`` (Gemma 2/3, gpt-oss, Cohere 2,
    Qwen2 with ``use_sliding_window``); the others apply ``sliding_window`` in every layer
    (Mistral, Mixtral, Phi-3) or have none. The attention op checks every layer against this at
    each call (``hf_integration``), so a model that disagrees fails loudly, never silently."""
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None) or 0
    types = getattr(hf_config, "layer_types", None)
    if types:
        return [window if kind == "sliding_attention" else 0 for kind in types]
    return [window] * num_layers


# Padding (slots no layer uses) a layout may waste, as a share of the layers, before a smaller group
# size (more groups: a block table and an attention plan more per step each) is taken instead.
MAX_PADDING = 0.05


def plan_groups(windows: list[int]) -> KVGroups:
    """Groups of equal size over layers of one kind each (see the module docstring).

    The group size divides the layer count of the rarest kind, so that kind (the full layers,
    in every model we serve: their pages grow with the sequence) wastes nothing; among those
    sizes, the largest whose padding of the other kinds' last groups stays within
    ``MAX_PADDING`` (Gemma-3-27B: 10 full and 52 windowed layers, groups of 5: 3 slots padded,
    where groups of 10 would pad 8)."""
    kinds = sorted(set(windows))  # 0 (full) first
    if len(kinds) == 1:
        return KVGroups((kinds[0],), len(windows), tuple((0, layer) for layer in range(len(windows))))
    layers_by_kind = {kind: [layer for layer, w in enumerate(windows) if w == kind] for kind in kinds}
    rarest = min(len(layers) for layers in layers_by_kind.values())

    def padding(size: int) -> int:
        return sum(-len(layers) % size for layers in layers_by_kind.values())

    slots = max(size for size in range(1, rarest + 1)
                if rarest % size == 0 and padding(size) <= MAX_PADDING * len(windows))
    group_windows: list[int] = []
    place: dict[int, tuple[int, int]] = {}
    for kind in kinds:
        layers = layers_by_kind[kind]
        for first in range(0, len(layers), slots):
            for slot, layer in enumerate(layers[first:first + slots]):
                place[layer] = (len(group_windows), slot)
            group_windows.append(kind)
    return KVGroups(tuple(group_windows), slots, tuple(place[layer] for layer in range(len(windows))))


def window_pages(window: int, block_size: int, num_tokens: int, step_tokens: int) -> int:
    """Most pages a windowed group's table holds for a sequence of ``num_tokens`` tokens, computed
    ``step_tokens`` at a time: the pages of the window before a step's first token plus those of
    the step (each may straddle a page boundary)."""
    full = -(-num_tokens // block_size)
    if not window:
        return full
    return min(full, -(-(window - 1 + min(step_tokens, num_tokens)) // block_size) + 1)
