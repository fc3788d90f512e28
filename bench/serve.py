"""Serving benchmark: a load generator against a running gateway (e.g. `splitserve up`).

Metrics follow vLLM's definitions (benchmark_serving): TTFT = request sent -> first token
received; TPOT = (E2E - TTFT) / (output tokens - 1) per request; ITL = every gap between
consecutive streamed tokens, pooled; E2E = sent -> last token. Throughput = output tokens /
wall time. Goodput = requests meeting every SLO per second (SLOs given in ms on the command
line). Requests are the `mixed` workload of shared/BENCHMARKS.md (token ids, ignore_eos), sent
all at once (`--rate inf`) or with Poisson arrivals at `--rate` requests/s.

    python -m bench.serve --address localhost:50051 --rate 2 --num-requests 32 --out bench/results/serve.json
    python -m bench.serve --address localhost:50051 --sweep-rates 0.5,1,2,4 --out bench/results/serve_sweep.json
    python -m bench.serve --http http://localhost:8000 --rate 2 --out bench/results/serve_http.json

The load generator itself (``GrpcBackend``, ``run_load``, ``summarize``) is the product's
``splitserve.cli.loadgen``, which ``splitserve tune`` drives too; this module adds sweeps,
relative SLOs, pooled rounds and the command line.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Sequence

from bench.common import write_json
from bench.metrics import AIM, DEFINITIONS
from splitserve.cli.loadgen import Backend, GrpcBackend, run_load, summarize, timeline_breakdown
from splitserve.cli.workloads import WORKLOADS, BenchRequest, fresh_tokens, poisson_offsets


def summarize_rounds(rounds: list[tuple[list[dict], float]], slo_ttft_ms: float = float("inf"),
                     slo_tpot_ms: float = float("inf"), by_kind: bool = False) -> dict:
    """Pool several rounds (records, wall) of one system: latencies over every request of every
    round, throughput = all tokens / all wall time. ``by_kind`` adds one summary per request kind."""
    if not rounds:
        raise ValueError("no rounds to summarize")
    records = [r for results, _ in rounds for r in results]
    wall = sum(w for _, w in rounds)
    summary = summarize(records, wall, slo_ttft_ms, slo_tpot_ms)
    summary["rounds"] = len(rounds)
    summary["gateway_timeline_p50"] = timeline_breakdown(records)
    if by_kind:
        kinds = sorted({r["kind"] for r in records})
        summary["by_kind"] = {}
        for k in kinds:
            mine = [r for r in records if r["kind"] == k]
            summary["by_kind"][k] = {**summarize(mine, wall, slo_ttft_ms, slo_tpot_ms),
                                     "gateway_timeline_p50": timeline_breakdown(mine)}
    return summary


def meets_aim(summary: dict) -> bool:
    """Issue 7's aim: TTFT p99 <= 100 ms and TPOT p50 <= 32 ms."""
    return summary["ttft_ms"]["p99"] <= AIM["ttft_p99_ms"] and summary["tpot_ms"]["p50"] <= AIM["tpot_p50_ms"]


def unloaded(backend: Backend, requests: Sequence[BenchRequest]) -> dict:
    """TTFT and TPOT with one request at a time: the reference relative SLOs are set from."""
    results, wall = run_load(backend, requests, None)
    s = summarize(results, wall, float("inf"), float("inf"))
    return {"ttft_ms_p50": s["ttft_ms"]["p50"], "tpot_ms_p50": s["tpot_ms"]["p50"], "requests": len(requests)}


def relative_slo(reference: dict, ttft_factor: float = 5.0, tpot_factor: float = 2.0) -> dict:
    """SLOs that carry across machines (shared/BENCHMARKS.md): multiples of the unloaded run."""
    return {"ttft_ms": ttft_factor * reference["ttft_ms_p50"], "tpot_ms": tpot_factor * reference["tpot_ms_p50"],
            "rule": f"TTFT <= {ttft_factor:g}x unloaded TTFT p50, TPOT <= {tpot_factor:g}x unloaded TPOT p50"}


def sweep(backends: dict[str, Backend], rates: Sequence[float], make_requests: Callable[[int], list[BenchRequest]],
          seed: int, slo: dict, warmup: Sequence[BenchRequest] = ()) -> dict[str, list[dict]]:
    """Latency vs load: every rate in turn, the backends interleaved at each rate.

    ``make_requests(i)`` gives the requests of the i-th rate (best: the same lengths with fresh
    prompt ids, ``workloads.fresh_tokens``, so every rate does the same work and none finds the
    previous one's prompts in the prefix cache); every backend gets the same requests.
    """
    for name, backend in backends.items():
        if warmup:
            run_load(backend, warmup, [0.0] * len(warmup))
    points: dict[str, list[dict]] = {name: [] for name in backends}
    for i, rate in enumerate(rates):
        requests = make_requests(i)
        offsets = poisson_offsets(len(requests), rate, seed)  # the same gaps, scaled by 1/rate
        for name, backend in backends.items():
            results, wall = run_load(backend, requests, offsets)
            s = summarize(results, wall, slo["ttft_ms"], slo["tpot_ms"])
            s["goodput_aim_requests_per_s"] = summarize(results, wall, AIM["ttft_p99_ms"],
                                                        AIM["tpot_p50_ms"])["goodput_requests_per_s"]
            s["offered_output_tokens_per_s"] = rate * sum(r.max_tokens for r in requests) / len(requests)
            s["meets_aim"] = meets_aim(s)
            s["gateway_timeline_p50"] = timeline_breakdown(results)
            points[name].append({"rate": rate, "summary": s})
            print(f"rate {rate:5.2f} {name:10s} TTFT p50 {s['ttft_ms']['p50']:8.1f} p99 {s['ttft_ms']['p99']:8.1f}  "
                  f"TPOT p50 {s['tpot_ms']['p50']:7.1f} p99 {s['tpot_ms']['p99']:7.1f}  "
                  f"{s['output_tokens_per_s']:6.1f} tok/s  failed {s['failed']}  retried {s['retried_requests']}",
                  flush=True)
    return points


def parse_rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be a comma list of numbers > 0 (inf allowed), got {text!r}")
    return rates


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="localhost:50051")
    parser.add_argument("--http", default="", metavar="URL",
                        help="drive an OpenAI-compatible HTTP endpoint instead of gRPC (e.g. http://localhost:8000: "
                             "the gateway's --http-port, or vLLM serve); streamed /v1/completions")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the model name sent over --http")
    parser.add_argument("--out", required=True, help="JSON file; a PNG is written beside it")
    parser.add_argument("--workload", default="mixed", choices=sorted(WORKLOADS))
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    parser.add_argument("--sweep-rates", type=parse_rates, default=None, metavar="R1,R2,...",
                        help="latency vs load: one run per Poisson rate (fresh prompts each), TTFT/TPOT p50/p99 "
                             "vs rate plotted; SLOs relative to an unloaded run")
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    args = parser.parse_args(argv)

    if args.http:
        from bench.openai_client import OpenAIBackend
        backend = OpenAIBackend(args.http, args.model)
    else:
        backend = GrpcBackend(args.address)
    out = Path(args.out)
    config = {k: (v if v != float("inf") else "inf") for k, v in vars(args).items()}
    if args.sweep_rates:
        base = WORKLOADS[args.workload](args.num_requests, args.vocab_size, seed=args.seed)
        make = lambda i: fresh_tokens(base, args.vocab_size, args.seed + 1000 * (i + 1))  # noqa: E731
        reference = unloaded(backend, WORKLOADS[args.workload](4, args.vocab_size, seed=args.seed + 999)[:4])
        slo = relative_slo(reference)
        points = sweep({"stack": backend}, args.sweep_rates, make, args.seed, slo)
        write_json(out, {"benchmark": "serve_sweep", "definitions": DEFINITIONS, "config": config,
                         "unloaded": reference, "slo": slo, "aim": AIM, "points": points})
        from bench.plots import plot_sweep
        plot_sweep(points, out.with_suffix(".png"), f"splitserve latency vs load — {args.workload}, "
                                                     f"{args.num_requests} requests per rate")
        return 0
    requests = WORKLOADS[args.workload](args.num_requests, args.vocab_size, seed=args.seed)
    offsets = poisson_offsets(len(requests), args.rate, args.seed)
    results, wall = run_load(backend, requests, offsets, progress=True)
    summary = summarize(results, wall, args.slo_ttft_ms, args.slo_tpot_ms)
    summary["gateway_timeline_p50"] = timeline_breakdown(results)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        p = summary[key]
        print(f"{key:8s} p50 {p['p50']:8.1f}  p90 {p['p90']:8.1f}  p99 {p['p99']:8.1f}")
    print(f"throughput {summary['output_tokens_per_s']:.1f} output tok/s, {summary['requests_per_s']:.2f} req/s, "
          f"goodput {summary['goodput_requests_per_s']:.2f} req/s, failed {summary['failed']}")
    write_json(out, {"benchmark": "serve", "definitions": DEFINITIONS, "config": config, "summary": summary})
    from bench.plots import plot_serve_cdfs
    plot_serve_cdfs(results, summary, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
