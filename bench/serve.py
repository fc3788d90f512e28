"""Serving benchmark: a gRPC load generator against a running gateway (e.g. `splitserve up`).

Metrics follow vLLM's definitions (benchmark_serving): TTFT = request sent -> first token
received; TPOT = (E2E - TTFT) / (output tokens - 1) per request; ITL = every gap between
consecutive streamed tokens, pooled; E2E = sent -> last token. Throughput = output tokens /
wall time. Goodput = requests meeting every SLO per second (SLOs given in ms on the command
line). Requests are the `mixed` workload of shared/BENCHMARKS.md (token ids, ignore_eos), sent
all at once (`--rate inf`) or with Poisson arrivals at `--rate` requests/s.

    python -m bench.serve --address localhost:50051 --rate 2 --num-requests 32 --out bench/results/serve.json
"""
from __future__ import annotations

import argparse
import random
import threading
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench.common import write_json
from bench.workloads import WORKLOADS
from splitserve.client import Client


def run_one(client: Client, request, results: list, index: int) -> None:
    sent = time.perf_counter()
    token_times: list[float] = []
    error = None
    try:
        for event in client.generate(request.prompt_token_ids, max_tokens=request.max_tokens, temperature=0.0,
                                     ignore_eos=True, timeout=600):
            if event.token_ids:
                now = time.perf_counter()
                token_times += [now] * len(event.token_ids)
    except Exception as e:  # recorded, not fatal: the report counts failures
        error = repr(e)
    results[index] = {"sent": sent, "token_times": token_times, "error": error,
                      "prompt_tokens": len(request.prompt_token_ids), "max_tokens": request.max_tokens}


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan")}
    arr = np.asarray(values) * 1000.0  # milliseconds
    return {"p50": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90)),
            "p99": float(np.percentile(arr, 99)), "mean": float(arr.mean())}


def summarize(results: list[dict], wall: float, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    ok = [r for r in results if r["error"] is None and r["token_times"]]
    ttft = [r["token_times"][0] - r["sent"] for r in ok]
    e2e = [r["token_times"][-1] - r["sent"] for r in ok]
    tpot = [(r["token_times"][-1] - r["token_times"][0]) / (len(r["token_times"]) - 1)
            for r in ok if len(r["token_times"]) > 1]
    itl = [b - a for r in ok for a, b in zip(r["token_times"], r["token_times"][1:])]
    output_tokens = sum(len(r["token_times"]) for r in ok)
    good = sum(1 for r in ok
               if 1000 * (r["token_times"][0] - r["sent"]) <= slo_ttft_ms
               and (len(r["token_times"]) < 2 or 1000 * (r["token_times"][-1] - r["token_times"][0])
                    / (len(r["token_times"]) - 1) <= slo_tpot_ms))
    return {"completed": len(ok), "failed": len(results) - len(ok), "wall_s": wall,
            "output_tokens": output_tokens, "output_tokens_per_s": output_tokens / wall,
            "requests_per_s": len(ok) / wall, "goodput_requests_per_s": good / wall,
            "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
            "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot), "itl_ms": percentiles(itl),
            "e2e_ms": percentiles(e2e)}


def plot(results: list[dict], summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in results if r["error"] is None and r["token_times"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (name, values) in zip(axes, (
            ("TTFT (ms)", [1000 * (r["token_times"][0] - r["sent"]) for r in ok]),
            ("ITL (ms)", [1000 * (b - a) for r in ok for a, b in zip(r["token_times"], r["token_times"][1:])]),
            ("E2E (ms)", [1000 * (r["token_times"][-1] - r["sent"]) for r in ok]))):
        values = np.sort(values)
        ax.plot(values, np.arange(1, len(values) + 1) / max(1, len(values)))
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    fig.suptitle(f"splitserve serving CDFs — {summary['completed']} requests, "
                 f"{summary['output_tokens_per_s']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="localhost:50051")
    parser.add_argument("--out", required=True, help="JSON file; a PNG of the CDFs is written beside it")
    parser.add_argument("--workload", default="mixed", choices=sorted(WORKLOADS))
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    args = parser.parse_args(argv)

    requests = WORKLOADS[args.workload](args.num_requests, args.vocab_size, seed=args.seed)
    rng = random.Random(args.seed)
    client = Client(args.address)
    results: list = [None] * len(requests)
    threads = []
    start = time.perf_counter()
    progress = tqdm(total=len(requests), desc="requests", unit="req")
    for i, request in enumerate(requests):
        if i and args.rate != float("inf"):
            time.sleep(rng.expovariate(args.rate))
        t = threading.Thread(target=run_one, args=(client, request, results, i), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
        progress.update(1)
    progress.close()
    wall = time.perf_counter() - start
    summary = summarize(results, wall, args.slo_ttft_ms, args.slo_tpot_ms)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        p = summary[key]
        print(f"{key:8s} p50 {p['p50']:8.1f}  p90 {p['p90']:8.1f}  p99 {p['p99']:8.1f}")
    print(f"throughput {summary['output_tokens_per_s']:.1f} output tok/s, {summary['requests_per_s']:.2f} req/s, "
          f"goodput {summary['goodput_requests_per_s']:.2f} req/s, failed {summary['failed']}")
    out = Path(args.out)
    write_json(out, {"benchmark": "serve", "definitions": "vLLM benchmark_serving (TTFT, TPOT, ITL, E2E)",
                     "config": {k: (v if v != float("inf") else "inf") for k, v in vars(args).items()},
                     "summary": summary})
    plot(results, summary, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
