"""Tensor parallelism inside one worker: N ranks (processes) share the model, one scheduler drives them.

* ``shard``: the model's linear layers split by the checkpoint's own tensor-parallel plan
  (``config.base_model_tp_plan`` in `transformers`): column-parallel q/k/v/gate/up, row-parallel
  o_proj/down_proj followed by an all-reduce. Attention heads and KV heads split with them, so
  each rank's KV pool holds its slice of every page (same page ids on every rank).
* ``ranks``: rank 0 (the worker process: scheduler, sampler, gRPC) starts ranks 1..N-1, sends
  each step's inputs to them over a local control socket, and watches them.
* ``splitserve.engine.tp_follower``: the process of rank r > 0, which runs every forward rank 0
  runs, on its shard (a KV connector runs its own program around it: ``TP_FOLLOWER`` is the plain one).

torch.distributed (gloo on CPU, NCCL on GPU) carries only the all-reduces inside the forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class FollowerProgram:
    """What ranks r > 0 run: ``python -m <module>``, whose ``main()`` calls
    ``splitserve.engine.tp_follower.run``; ``cleanup(pid)`` removes what a rank killed outright
    left behind (a KV connector's shared-memory pool, say). A worker that wires a KV connector
    passes its own (``LLMEngine(tp_follower=...)``)."""

    module: str = "splitserve.engine.tp_follower"
    cleanup: Callable[[int], None] | None = None


TP_FOLLOWER = FollowerProgram()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the GPU ``rank`` after rank 0's (cuda:K -> cuda:K+rank); CPU stays CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def dist_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"
