"""Decode step time of the engine by batch size and context length (no cliff, or where it is).

Every cell holds ``batch`` sequences whose ``context`` tokens of KV already sit in the pool
(pages reserved and marked computed, as a handoff from a prefill worker leaves them; the KV
values do not change the time), then times whole ``engine.step()`` calls, each one decode
token per sequence: scheduling, input building, the forward, sampling and the update. Median
of ``--steps`` steps after two warm-up steps. ``--modes compiled,eager`` measures both steps
in one run, the cells interleaved; a mode ending in ``+async`` runs with async scheduling on
(splitserve/engine/async_scheduling.py: each ``step()`` launches the next step before it reads
the tokens of the one before), the others with it off. A mode ending in ``@<linear backend>`` runs
with that ``linear_backend`` (``compiled@onednn,compiled@onednn-matmul``: the two ways of packing the
CPU linears, interleaved); ``--rounds`` measures every cell that many times, the engines in turn.

    python -m bench.step_time --batches 1,8,32,64,128 --contexts 200,1000 --out bench/results/step_time.json
"""
from __future__ import annotations

import argparse
import itertools
import time

import torch

from bench.common import median, write_json


def build(model: str, dtype: str, mode: str, batches: list[int], contexts: list[int]):
    from splitserve.engine import LLM
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.model_loader import load_config, resolve_model
    hf = load_config(resolve_model(model))
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    from splitserve.engine.model_runner import resolve_device, resolve_dtype
    element = torch.empty((), dtype=resolve_dtype(dtype, resolve_device("auto"))).element_size()
    tokens = max(batches) * (max(contexts) + 64)
    gb = tokens * 2 * hf.num_hidden_layers * kv_heads * head_dim * element / 2**30 * 1.1
    start = time.perf_counter()
    mode, _, linear_backend = mode.partition("@")
    step_mode, _, overlap = mode.partition("+")
    llm = LLM(model, dtype=dtype, enforce_eager=step_mode == "eager", max_num_seqs=max(batches),
              linear_backend=linear_backend or "auto",
              async_scheduling="on" if overlap == "async" else "off",
              max_num_batched_tokens=max(EngineConfig.max_num_batched_tokens, max(batches)),
              kv_cache_memory_gb=gb, enable_prefix_caching=False, max_model_len=max(contexts) + 1024)
    return llm, time.perf_counter() - start


def measure(llm, batch: int, context: int, steps: int, temperature: float = 0.0) -> tuple[float, dict[str, float]]:
    """The median step time (s) and the mean time per step of each phase (ms; the engine's own
    timers, splitserve/engine/step_phases.py) over the timed steps."""
    from splitserve.engine import SamplingParams
    engine = llm.engine
    params = SamplingParams(temperature=temperature, max_tokens=steps + 8, ignore_eos=True)
    vocab = llm.engine.vocab_size
    ids = []
    for i in range(batch):
        rid = f"b{batch}-c{context}-{i}"
        prompt = [(i * 131 + j) % vocab for j in range(context)]
        if engine.kv.allocate(rid, context) is None:
            raise RuntimeError("KV pool too small for the cell")
        engine.add_prefilled_request(rid, prompt, params, first_token=1)
        ids.append(rid)
    try:
        for _ in range(2):
            engine.step()
        phases = engine.runner.phases
        before = phases.seconds()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        after = phases.seconds()
    finally:
        for rid in ids:
            engine.abort_request(rid)
        engine.land()  # with async scheduling, the pages of the step in flight come back when it lands
    return median(times), {phase: 1000 * (after[phase] - before[phase]) / steps for phase in after}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", default="1,8,32,64,128")
    parser.add_argument("--contexts", default="200,1000")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--modes", default="compiled",
                        help="compiled, eager, either with +async (comma-separated)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: random sampling")
    parser.add_argument("--rounds", type=int, default=1, help="measure every cell this many times")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    modes = args.modes.split(",")

    engines = {}
    for mode in modes:
        engines[mode] = build(args.model, args.dtype, mode, batches, contexts)
        print(f"{mode}: up in {engines[mode][1]:.1f} s (compile {engines[mode][0].engine.runner.forward.warmup_s:.1f} s)",
              flush=True)
    cells = []
    for round_, context, batch in itertools.product(range(args.rounds), contexts, batches):
        cell = {"batch": batch, "context": context, "round": round_}
        for mode, (llm, _) in engines.items():
            step_s, phase_ms = measure(llm, batch, context, args.steps, args.temperature)
            cell[f"{mode}_ms"] = 1000 * step_s
            cell[f"{mode}_us_per_seq"] = 1e6 * step_s / batch
            # Host work: everything but the forward (schedule, inputs, sampling, update).
            cell[f"{mode}_host_ms"] = sum(ms for phase, ms in phase_ms.items() if phase != "forward")
            cell[f"{mode}_phase_ms"] = phase_ms
        print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in cell.items()
                        if not isinstance(v, dict)),
              flush=True)
        cells.append(cell)
    write_json(args.out, {
        "benchmark": "step_time",
        "config": {"model": args.model, "dtype": str(engines[modes[0]][0].engine.runner.dtype), "modes": modes,
                   "linear_backends": {m: e[0].engine.runner.linear_backend for m, e in engines.items()},
                   "rounds": args.rounds, "steps": args.steps, "batches": batches, "contexts": contexts, "temperature": args.temperature,
                   "startup_s": {m: e[1] for m, e in engines.items()},
                   "compile_s": {m: e[0].engine.runner.forward.warmup_s for m, e in engines.items()}},
        "method": "decode steps over pages already holding `context` tokens; median engine.step() time; "
                  "host_ms: the mean of every phase but the forward, by the engine's phase timers",
        "cells": cells,
    })
    return 0


if __name__ == "__main__":
    from splitserve.cli.allocator import restart_with_tcmalloc
    restart_with_tcmalloc()  # as the workers run (splitserve/cli/allocator.py)
    raise SystemExit(main())
