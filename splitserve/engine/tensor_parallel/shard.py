"""Split a `transformers` causal LM across tensor-parallel ranks, by the model's own TP plan.

`transformers` declares, per architecture, which linear layers are column-parallel (outputs
split: q/k/v, gate/up) and which are row-parallel (inputs split, outputs summed across ranks:
o_proj, down_proj) in ``config.base_model_tp_plan``. Its own ``from_pretrained(tp_plan=...)``
turns them into DTensors; the paged step needs plain tensors (oneDNN-packed on a CPU, one
compiled graph), so the plan is applied here by slicing each weight once: rank r keeps heads
[r*H/N, (r+1)*H/N) of q and KV heads [r*K/N, (r+1)*K/N) of k/v, which keeps every query head
with its KV head under GQA. A row-parallel layer's partial outputs are summed by one opaque op,
``splitserve::tp_all_reduce``, so a compiled forward keeps every layer in one graph. The op names
its process group by a number (``register_group``): a test process may hold two tensor-parallel
engines (a prefill and a decode one), each with a group of its own.
"""
from __future__ import annotations

import itertools
import re

import torch

_groups: dict[int, object] = {}
_ids = itertools.count(1)


def register_group(group) -> int:
    """A number for ``group`` (an ``splitserve.engine.tensor_parallel.all_reduce`` communicator: tensor ->
    its sum over the ranks) that the all-reduce op can carry."""
    group_id = next(_ids)
    _groups[group_id] = group
    return group_id


def unregister_group(group_id: int) -> None:
    _groups.pop(group_id, None)


def tp_all_reduce(x: torch.Tensor, group: int) -> torch.Tensor:
    return _groups[group](x)


_lib = torch.library.Library("splitserve", "FRAGMENT")
_lib.define("tp_all_reduce(Tensor x, int group) -> Tensor")
_lib.impl("tp_all_reduce", tp_all_reduce, "CompositeExplicitAutograd")


@torch.library.register_fake("splitserve::tp_all_reduce")
def _(x, group):
    return torch.empty_like(x)


class RowParallelLinear(torch.nn.Module):
    """This rank's columns of a linear layer; the partial products of all ranks are summed, then
    the bias (whole, on every rank) is added once."""

    def __init__(self, shard: torch.nn.Linear, bias: torch.Tensor | None, group: int):
        super().__init__()
        self.linear = shard
        self.group = group
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.splitserve.tp_all_reduce(self.linear(x), self.group)
        return out if self.bias is None else out + self.bias


def check_divisible(hf_config, world: int) -> None:
    """A clear error where the model's heads (or MLP width) do not split evenly over ``world`` ranks."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    width = getattr(hf_config, "intermediate_size", 0)
    bad = [f"{n} {what}" for n, what in ((heads, "attention heads"), (kv_heads, "KV heads"),
                                          (width, "MLP columns")) if n % world]
    if bad:
        raise ValueError(f"tensor_parallel_size {world} does not divide this model's " + ", ".join(bad)
                         + f" (it has {heads} attention heads and {kv_heads} KV heads): pick a size that "
                         "divides both, e.g. " + ", ".join(str(d) for d in range(1, kv_heads + 1)
                                                            if kv_heads % d == 0 and heads % d == 0))


def _slice_linear(linear: torch.nn.Linear, dim: int, rank: int, world: int) -> torch.nn.Linear:
    weight = linear.weight.detach()
    size = weight.shape[dim] // world
    part = weight.narrow(dim, rank * size, size).contiguous()
    out = torch.nn.Linear(part.shape[1], part.shape[0], bias=False, device=part.device, dtype=part.dtype)
    out.weight = torch.nn.Parameter(part, requires_grad=False)
    return out


def shard_model(model: torch.nn.Module, rank: int, world: int, group: int) -> int:
    """Keep rank ``rank``'s shard of every layer of ``model`` (a `*ForCausalLM`) named in its TP
    plan, in place, summing row-parallel outputs over ``group`` (``register_group``); returns the
    number of layers sharded. Embeddings, norms and the LM head stay
    whole on every rank (only rank 0 computes logits)."""
    hf = model.config
    check_divisible(hf, world)
    plan = getattr(hf, "base_model_tp_plan", None) or {}
    if not plan:
        raise ValueError(f"{type(model).__name__} declares no tensor-parallel plan (config.base_model_tp_plan); "
                         "tensor_parallel_size > 1 needs one")
    base = model.model
    rules = [(re.compile(pattern.replace(".", r"\.").replace("*", r"\d+")), style) for pattern, style in plan.items()]
    sharded = 0
    for name, module in list(base.named_modules()):
        style = next((s for regex, s in rules if regex.fullmatch(name)), None)
        if style is None:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = base.get_submodule(parent_name)
        if hasattr(module, "narrowed") and style in ("colwise", "rowwise"):
            # A quantized checkpoint's linear: its codes, scales and offsets split like a weight.
            if style == "colwise":
                setattr(parent, child, module.narrowed(0, rank, world, keep_bias=True))
            else:
                setattr(parent, child, RowParallelLinear(module.narrowed(1, rank, world, keep_bias=False),
                                                         module.bias, group))
            sharded += 1
            continue
        if not isinstance(module, torch.nn.Linear):
            raise ValueError(f"tensor-parallel plan names {name} ({type(module).__name__}); only linear layers are "
                             "split here")
        if style == "colwise":
            shard = _slice_linear(module, 0, rank, world)
            if module.bias is not None:
                size = module.bias.shape[0] // world
                shard.bias = torch.nn.Parameter(module.bias.detach()[rank * size:(rank + 1) * size].clone(),
                                                requires_grad=False)
            setattr(parent, child, shard)
        elif style == "rowwise":
            bias = None if module.bias is None else module.bias.detach()
            setattr(parent, child, RowParallelLinear(_slice_linear(module, 1, rank, world), bias, group))
        else:
            raise ValueError(f"tensor-parallel style {style!r} of {name} is not supported (colwise and rowwise are)")
        sharded += 1
    return sharded


def local_heads(hf_config, world: int) -> tuple[int, int]:
    """(attention heads, KV heads) each rank holds."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    return heads // world, kv_heads // world
