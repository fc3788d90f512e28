"""Rotary embeddings read from a table of every position's cos/sin, not computed each step.

A `transformers` rotary module computes ``cos(position * inv_freq)`` and ``sin(...)`` for the
step's positions, once a forward. Compiled, inductor does not keep that result: it fuses the
trigonometry into each layer's q/k rotation kernel, so every layer evaluated it again, per head
(SmolLM2, 250-token prefill, bf16, 2 Xeon cores: that kernel took ~124 us a layer, ~3.7 ms of an
~83 ms prefill). vLLM keeps a cos/sin cache for the same reason.

``cache_rotary_embeddings`` swaps each rotary module of a model for ``CachedRotaryEmbedding``,
which indexes a table built once by the module itself over positions ``0 .. length - 1`` (the
runner's ``max_model_len``, or further where a start-up step reaches).
Each table entry is computed exactly as the module computes it for that position (one product
per frequency, then cos/sin and the attention scaling, then the cast), so a lookup returns the
same values bit for bit: that is checked on construction, and a module it does not hold for
keeps computing. Rotary types whose frequencies change with the sequence length ("dynamic",
"longrope") keep computing too.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# Rotary types whose inv_freq depends on the longest position seen (modeling_rope_utils.dynamic_rope_update).
_LENGTH_DEPENDENT = ("dynamic", "longrope")


def _rope_types(module: torch.nn.Module) -> dict[str | None, str] | None:
    """The module's rotary type per layer type (key None: one type for every layer), or None
    when it does not look like a `transformers` rotary embedding."""
    rope_type = getattr(module, "rope_type", None)
    if isinstance(rope_type, str):
        return {None: rope_type}
    if isinstance(rope_type, dict) and all(isinstance(v, str) for v in rope_type.values()):
        return dict(rope_type)
    return None


class CachedRotaryEmbedding(torch.nn.Module):
    """``inner``'s (cos, sin) for positions below ``length``, looked up; the same call signature."""

    def __init__(self, inner: torch.nn.Module, layer_types: list[str | None], length: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.inner = inner
        self.length = length
        self.dtype = dtype
        positions = torch.arange(length, device=device)[None]
        probe = torch.empty(0, dtype=dtype, device=device)  # the module reads only its dtype and device
        self._names: dict[str | None, tuple[str, str]] = {}
        for layer_type in layer_types:
            kwargs = {} if layer_type is None else {"layer_type": layer_type}
            cos, sin = inner(probe, positions, **kwargs)
            key = layer_type or "all"
            self.register_buffer(f"cos_{key}", cos[0].contiguous(), persistent=False)
            self.register_buffer(f"sin_{key}", sin[0].contiguous(), persistent=False)
            self._names[layer_type] = (f"cos_{key}", f"sin_{key}")

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        if x.dtype != self.dtype:  # the table is the module's answer for the model's dtype only
            return self.inner(x, position_ids, **({} if layer_type is None else {"layer_type": layer_type}))
        cos_name, sin_name = self._names[layer_type]
        return getattr(self, cos_name)[position_ids], getattr(self, sin_name)[position_ids]


def _matches(cached: CachedRotaryEmbedding, inner: torch.nn.Module, layer_types, dtype, device) -> bool:
    """Whether lookups equal the module's own result, bit for bit, on positions spread over the table."""
    length = cached.length
    positions = torch.tensor([[0, 1, length // 3, length // 2, length - 1]], device=device)
    probe = torch.empty(0, dtype=dtype, device=device)
    for layer_type in layer_types:
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        want = inner(probe, positions, **kwargs)
        got = cached(probe, positions, layer_type)
        if any(w.shape != g.shape or w.dtype != g.dtype or not torch.equal(w, g) for w, g in zip(want, got)):
            return False
    return True


def cache_rotary_embeddings(model: torch.nn.Module, length: int, dtype: torch.dtype, device: torch.device) -> int:
    """Swap every static rotary module of ``model`` for a table of ``length`` positions; returns
    how many were swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            types = _rope_types(child)
            if types is None or not (hasattr(child, "inv_freq") or any(hasattr(child, f"{t}_inv_freq") for t in types if t)):
                continue
            if any(marker in rope for rope in types.values() for marker in _LENGTH_DEPENDENT):
                continue
            layer_types = list(types) if None not in types else [None]
            try:
                with torch.no_grad():
                    cached = CachedRotaryEmbedding(child, layer_types, length, dtype, device)
                    ok = _matches(cached, child, layer_types, dtype, device)
            except Exception as e:  # an unusual signature or output: the module keeps computing
                log.info("rotary module %s kept as it is: %s", type(child).__name__, e)
                continue
            if not ok:
                log.info("rotary module %s kept as it is: the table differs from its result", type(child).__name__)
                continue
            setattr(parent, name, cached)
            swapped += 1
    log.info("rotary embeddings: %d module(s) read from a table of %d positions", swapped, length)
    return swapped
