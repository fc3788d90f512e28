"""Plugs the paged attention backends into the model code of `transformers`.

`transformers` calls the registered function from every attention layer with query/key/
value after rotary embedding, the module (which knows its ``layer_idx``) and every extra
keyword argument given to the model's forward: the runner passes one ``PagedForward``
under the name ``splitserve``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers import AttentionInterface

from engine.attention.backend import AttentionBackend, StepLayout

ATTN_IMPLEMENTATION = "splitserve_paged"


@dataclass
class PagedForward:
    backend: AttentionBackend
    layout: StepLayout
    prepared: object
    # (k_cache, v_cache) per layer, each [num_blocks, block_size, num_kv_heads, head_dim].
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    # Called after a layer's K/V are in the cache (layer-by-layer KV transfer hooks in here).
    on_layer_written: Callable[[int], None] | None = None


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0, **kwargs):
    step: PagedForward | None = kwargs.get("splitserve")
    if step is None:
        raise RuntimeError(f"the {ATTN_IMPLEMENTATION} attention needs the runner's step (splitserve=...)")
    layer = module.layer_idx
    # [1, H, T, D] -> [T, H, D]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = step.backend.forward(q, k, v, *step.kv_caches[layer], step.layout, step.prepared, scale)
    if step.on_layer_written is not None:
        step.on_layer_written(layer)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
