"""Plugs the paged attention backends into the model code of `transformers`.

`transformers` calls the registered function from every attention layer with query/key/
value after rotary embedding and the module (which knows its ``layer_idx``). The function
calls one custom op, ``splitserve::paged_attention``, with only the layer's tensors and its
index: a compiled forward keeps each layer's attention as one opaque node (no graph break),
and everything that describes the step (block tables, slots, lengths, the backend's plan,
the pool, the layer hook) comes from the ``StepContext`` the runner enters around the
forward, as vLLM's forward context does. What a layer does beyond causal attention
(``sliding_window``, ``softcap``, ``s_aux``: the keyword arguments transformers passes the
attention function of Mistral, Gemma 2/3, gpt-oss and the like) travels as the op's own
arguments, so layers of one model may differ. The op writes the layer's new K/V into the pool
itself; no other op reads the pool, so that hidden write cannot be reordered past a reader.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from transformers import AttentionInterface

from splitserve.engine.attention.backend import PLAIN, AttentionBackend, AttentionVariant, StepLayout

ATTN_IMPLEMENTATION = "splitserve_paged"


@dataclass
class StepContext:
    backend: AttentionBackend
    layout: StepLayout
    prepared: object
    # (k_cache, v_cache) per layer, each [num_blocks, block_size, num_kv_heads, head_dim].
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    # Called after a layer's K/V are in the cache (layer-by-layer KV transfer hooks in here).
    on_layer_written: Callable[[int], None] | None = None
    # Layers in KV groups of their own (``kv_groups``): each group's (layout, prepared) —
    # group 0's are ``layout`` and ``prepared`` — its window, and each layer's group. Empty: one group.
    group_steps: tuple[tuple[StepLayout, object], ...] = ()
    group_windows: tuple[int, ...] = ()
    layer_group: tuple[int, ...] = ()


_local = threading.local()


@contextlib.contextmanager
def step_context(ctx: StepContext) -> Iterator[None]:
    """The step every paged attention call on this thread belongs to, for one forward."""
    previous = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield
    finally:
        _local.ctx = previous


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int,
                    scale: float, window: int = 0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, Hq, D], key/value [T, Hkv, D] of one layer -> [T, Hq, D]; writes K/V into the pool."""
    ctx: StepContext | None = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError(f"the {ATTN_IMPLEMENTATION} attention runs only inside the runner's step_context()")
    if window or softcap or sinks is not None:  # the kernels take sinks as float32 (a model's are in its dtype)
        variant = AttentionVariant(window, softcap, None if sinks is None else sinks.float().contiguous())
    else:
        variant = PLAIN
    layout, prepared = ctx.layout, ctx.prepared
    if ctx.layer_group:
        group = ctx.layer_group[layer]
        if ctx.group_windows[group] and window != ctx.group_windows[group]:
            # The pool gave this layer's pages back behind a window it does not attend through.
            raise RuntimeError(f"layer {layer} attends with sliding window {window or 'none'}, but its KV group frees "
                               f"pages behind a window of {ctx.group_windows[group]} (kv_groups.layer_windows "
                               "read this model's config wrongly; --disable-hybrid-kv-cache-manager serves it)")
        if group:
            layout, prepared = ctx.group_steps[group]
    out = ctx.backend.forward(query, key, value, *ctx.kv_caches[layer], layout, prepared, scale, variant)
    if ctx.on_layer_written is not None:
        ctx.on_layer_written(layer)
    return out


# Registered through torch.library.Library rather than the @custom_op decorator: the same op
# for the compiler, at half the dispatch cost per call (9 vs 20 us), paid 30 times a step.
_lib = torch.library.Library("splitserve", "DEF")
_lib.define("paged_attention(Tensor query, Tensor key, Tensor value, int layer, float scale, int window=0, "
            "float softcap=0.0, Tensor? sinks=None) -> Tensor")
_lib.impl("paged_attention", paged_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("splitserve::paged_attention")
def _(query, key, value, layer, scale, window=0, softcap=0.0, sinks=None):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0, **kwargs):
    # [1, H, T, D] -> [T, H, D]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    out = torch.ops.splitserve.paged_attention(q, k, v, module.layer_idx, float(scale), int(window or 0),
                                               float(softcap or 0.0), sinks)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
