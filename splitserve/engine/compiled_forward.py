"""The model's forward as the runner calls it: (input_ids [T], positions [T]) -> hidden [T, H].

Eager (``enforce_eager``): the `transformers` modules run op by op, Python per layer.

Compiled (the default, as vLLM does): ``torch.compile`` traces the whole forward, every
layer, into one graph; each layer's paged attention stays one opaque custom op
(``splitserve::paged_attention``), so nothing breaks the graph. The token count is marked
*unbacked*, so one graph serves every batch shape (a decode of one sequence and a 2,048-token
prefill alike) with no recompilation as the batch changes. On a CPU the linear layers are
already packed for oneDNN by then (splitserve/engine/cpu_linear.py), opaque ops the graph calls. inductor's
freezing, which should prepack them itself, is left off: on an AVX-512 BF16 Zen 5 in bf16 it left
them as plain ``aten::mm`` (with the unbacked token count), and on an AVX2 CPU in fp32 its
MKL-packed linears measured slower than plain ones (10 vs 30 GF/s at 8 rows). The compile happens
once, at start-up, on a dummy batch (``warmup_s`` says how long it took); after it, steps skip
dynamo's guard evaluation (see _STANCE_LOCK);
inductor's on-disk cache makes later start-ups of the same model fast.

On CUDA the same graph runs, and the runner captures it as CUDA graphs for padded decode batch
sizes (splitserve/engine/cuda_graphs.py).
"""
from __future__ import annotations

import logging
import os
import threading
import time
import types

import torch

from splitserve.engine.config import EngineConfig

log = logging.getLogger(__name__)


class EagerForward:
    warmup_s = 0.0

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids[None], position_ids=positions[None],
                          use_cache=False).last_hidden_state[0]

    def describe(self) -> str:
        return "eager"


# Before each call of a compiled function dynamo evaluates its guards, ~7,800 here (the type,
# dict and tensor checks of every module and parameter the forward reads): 2-4 ms of a 12-30 ms
# decode step on 2 Zen 5 cores. Once warm-up has compiled a forward, nothing they check changes
# (one graph serves every token count, the model is fixed), so later calls run under dynamo's
# skip_guard_eval_unsafe stance, which checks only what tells cached graphs apart (vLLM's compile
# wrapper skips them too). That stance is process-wide, and a forward compiling (another engine's
# warm-up) must not run inside it, or it would reuse a graph of another model unchecked: one
# lock holds both, so they never overlap.
_STANCE_LOCK = threading.RLock()

# inductor's default wrapper is Python: per op of the graph (~15 a layer) a Python call, an
# allocation, a size check, with the GIL held between ops. Its cpp_wrapper emits that code as C++
# instead, which runs with the GIL released but for our attention op's own Python. SmolLM2-135M
# bf16 on 2 Xeon cores (AMX), offline, medians of 9: a prompt's prefill 26.2 -> 24.3 ms (30 tokens),
# 50.3 -> 46.3 (150), 74.8 -> 68.7 (250); a decode step of 4 sequences 22.5 -> 20.3 ms. A compile
# from an empty inductor cache takes longer (SmolLM2: 40.6 -> 66.3 s), one from it as long. The CUDA path
# keeps the Python wrapper: its decode steps replay CUDA graphs, which skip it anyway.
def cpp_wrapper_wanted(device: torch.device) -> bool:
    """On a CPU, unless inductor's own switch says no (``TORCHINDUCTOR_CPP_WRAPPER=0``)."""
    return device.type == "cpu" and os.environ.get("TORCHINDUCTOR_CPP_WRAPPER", "1") != "0"


class CompiledForward:
    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.eager = EagerForward(model)
        self.device = device
        # inductor's options: on a CPU the graph's host code is C++ too (see cpp_wrapper_wanted).
        self.options = {"cpp_wrapper": True} if cpp_wrapper_wanted(device) else None
        self._compiled = torch.compile(_forward_for(self.eager), fullgraph=True, dynamic=False, options=self.options)
        self.warmup_s = 0.0
        self.skip_guards = False  # set by warm_up

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Unbacked: no guard on the token count, hence one graph for every step (a backed size
        # would be specialised on 1 and recompiled as batches change).
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        with _STANCE_LOCK:
            if not self.skip_guards:
                return self._compiled(input_ids, positions)
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self._compiled(input_ids, positions)

    def warm_up(self, run_dummy_step) -> None:
        """Compile now, on a dummy step the runner provides, instead of inside the first request;
        later calls skip the guards (see _STANCE_LOCK)."""
        start = time.perf_counter()
        with _STANCE_LOCK:
            run_dummy_step()
            self.skip_guards = True
        self.warmup_s = time.perf_counter() - start
        log.info("compiled the forward in %.1f s", self.warmup_s)

    def describe(self) -> str:
        return f"compiled ({self.warmup_s:.1f} s)"


# One copy of the forward's code object per model (its class, config, dtype and device). dynamo
# keeps its compiled graphs, and counts recompiles, per code object: with one shared by every
# engine, each engine of another model in a process (a notebook, a test run, ``tune``) was a
# recompile of the same code, and the ninth failed on dynamo's recompile limit. Engines of one
# model still share a code object, and so the graph compiled for the first of them.
_FORWARD_CODES: dict[tuple, types.CodeType] = {}


def _forward_for(eager: EagerForward) -> types.MethodType:
    """``eager.__call__``, with the code object of ``eager``'s model (see _FORWARD_CODES)."""
    model = eager.model
    param = next(model.parameters(), None)
    key = (type(model).__qualname__, model.config.to_json_string(use_diff=False),
           None if param is None else (param.dtype, param.device))
    fn = EagerForward.__call__
    code = _FORWARD_CODES.setdefault(key, fn.__code__.replace())
    return types.MethodType(types.FunctionType(code, fn.__globals__, fn.__name__), eager)


def build_forward(model: torch.nn.Module, config: EngineConfig, device: torch.device):
    if config.enforce_eager:
        return EagerForward(model)
    return CompiledForward(model, device)
