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

The load generator is a library too (bench/compare.py uses it): a *backend* is anything with
``stream(request, meta) -> iterator of token-id lists`` (``GrpcBackend`` here, the in-process engine
in bench/stack.py); ``run_load`` sends requests at given offsets and records when every token
arrives; ``summarize`` turns those records into the metrics above.
"""
from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np

from bench.common import write_json
from bench.metrics import AIM, DEFINITIONS
from bench.workloads import WORKLOADS, BenchRequest, fresh_tokens, poisson_offsets

class Backend(Protocol):
    def stream(self, request: BenchRequest, meta: dict) -> Iterator[list[int]]:
        """The request's output tokens, in the chunks they arrive in; ``meta`` collects notes (retries)."""


class GrpcBackend:
    """The public gRPC API of a gateway, greedy with ignore_eos (the workload fixes the lengths).

    A request refused with UNAVAILABLE before its first token (the gateway briefly sees no
    usable worker) is sent again every 0.2 s for up to ``retry_unavailable_s``, as a client
    would; its TTFT still counts from the first send and ``meta["retries"]`` records the tries.
    """

    def __init__(self, address: str, retry_unavailable_s: float = 10.0):
        from splitserve.client import Client
        self.address = address
        self.client = Client(address)
        self.retry_unavailable_s = retry_unavailable_s

    def stream(self, request: BenchRequest, meta: dict) -> Iterator[list[int]]:
        import grpc
        give_up = time.monotonic() + self.retry_unavailable_s
        while True:
            streamed = False
            try:
                for event in self.client.generate(request.prompt_token_ids, max_tokens=request.max_tokens,
                                                  temperature=0.0, ignore_eos=True, timeout=600):
                    if event.token_ids:
                        streamed = True
                        yield event.token_ids
                    if event.finished and event.timeline is not None:
                        t = event.timeline
                        meta["timeline"] = {"queued_ms": t.queued_ms, "prefill_ms": t.prefill_ms,
                                            "kv_transfer_ms": t.kv_transfer_ms, "first_token_ms": t.first_token_ms}
                return
            except grpc.RpcError as e:
                if streamed or e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > give_up:
                    raise
                meta["retries"] = meta.get("retries", 0) + 1
                time.sleep(0.2)

    def close(self) -> None:
        self.client.close()


def run_one(backend: Backend, request: BenchRequest, results: list, index: int) -> None:
    sent = time.perf_counter()
    token_times: list[float] = []
    error = None
    meta: dict = {}
    try:
        for token_ids in backend.stream(request, meta):
            now = time.perf_counter()
            token_times += [now] * len(token_ids)
    except Exception as e:  # recorded, not fatal: the report counts failures
        error = repr(e)
    results[index] = {"sent": sent, "token_times": token_times, "error": error, "kind": request.kind,
                      "prompt_tokens": len(request.prompt_token_ids), "max_tokens": request.max_tokens,
                      "retries": meta.get("retries", 0), "timeline": meta.get("timeline")}


def run_load(backend: Backend, requests: Sequence[BenchRequest], offsets: Sequence[float] | None = None,
             progress: bool = False) -> tuple[list[dict], float]:
    """Send ``requests[i]`` at ``offsets[i]`` s after the start (each on its own thread).

    ``offsets=None`` sends them one at a time, each after the previous one ended (unloaded).
    Returns one record per request (send time, arrival time of every token, error) and the wall time.
    """
    results: list = [None] * len(requests)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(requests), desc="requests", unit="req")
    start = time.perf_counter()
    if offsets is None:
        for i, request in enumerate(requests):
            run_one(backend, request, results, i)
            if bar:
                bar.update(1)
    else:
        if len(offsets) != len(requests):
            raise ValueError(f"{len(offsets)} offsets for {len(requests)} requests")
        threads = []
        for i, (request, offset) in enumerate(zip(requests, offsets)):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            t = threading.Thread(target=run_one, args=(backend, request, results, i), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
            if bar:
                bar.update(1)
    if bar:
        bar.close()
    return results, time.perf_counter() - start


def percentiles(values: list[float]) -> dict[str, float]:
    """p50/p90/p99/mean/max of values in seconds, in milliseconds."""
    if not values:
        return {k: float("nan") for k in ("p50", "p90", "p99", "mean", "max")}
    arr = np.asarray(values) * 1000.0  # milliseconds
    return {"p50": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90)),
            "p99": float(np.percentile(arr, 99)), "mean": float(arr.mean()), "max": float(arr.max())}


def _tpot(r: dict) -> float | None:
    t = r["token_times"]
    return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


def summarize(results: list[dict], wall: float, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    ok = [r for r in results if r["error"] is None and r["token_times"]]
    ttft = [r["token_times"][0] - r["sent"] for r in ok]
    e2e = [r["token_times"][-1] - r["sent"] for r in ok]
    tpot = [x for x in map(_tpot, ok) if x is not None]
    itl = [b - a for r in ok for a, b in zip(r["token_times"], r["token_times"][1:])]
    output_tokens = sum(len(r["token_times"]) for r in ok)
    good = sum(1 for r in ok if 1000 * (r["token_times"][0] - r["sent"]) <= slo_ttft_ms
               and (_tpot(r) is None or 1000 * _tpot(r) <= slo_tpot_ms))
    errors = sorted({r["error"] for r in results if r["error"] is not None})
    retried = [r.get("retries", 0) for r in results if r.get("retries", 0)]
    return {"completed": len(ok), "failed": len(results) - len(ok), "errors": errors[:5],
            "retried_requests": len(retried), "retries": sum(retried), "wall_s": wall,
            "output_tokens": output_tokens, "output_tokens_per_s": output_tokens / wall,
            "requests_per_s": len(ok) / wall, "goodput_requests_per_s": good / wall,
            "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
            "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot), "itl_ms": percentiles(itl),
            "e2e_ms": percentiles(e2e), "slowest_ttft": slowest_ttft(results)}


def slowest_ttft(results: list[dict]) -> dict:
    """The request with the longest TTFT: its index, when it was sent (s after the round's first
    send), its prompt length and the gateway's timeline of it, to tell an outlier's cause
    (the first request after an idle spell, a long prompt, a queue) from the figures."""
    ok = [(i, r) for i, r in enumerate(results) if r["error"] is None and r["token_times"]]
    if not ok:
        return {}
    first_sent = min(r["sent"] for _, r in ok)
    i, r = max(ok, key=lambda item: item[1]["token_times"][0] - item[1]["sent"])
    return {"index": i, "sent_s": r["sent"] - first_sent, "ttft_ms": 1000 * (r["token_times"][0] - r["sent"]),
            "prompt_tokens": r["prompt_tokens"], "timeline": r.get("timeline") or {}}


def timeline_breakdown(results: list[dict]) -> dict:
    """Medians (ms) of the gateway's own timeline of each request, beside the client's TTFT:
    queued (admission -> a dispatcher claimed it), prefill compute, KV transfer not hidden by
    compute, first token at the gateway; ``client_minus_gateway_ttft`` is what the client saw on
    top (the client <-> gateway hop and the retries). Empty for backends without a timeline."""
    ok = [r for r in results if r["error"] is None and r["token_times"] and r.get("timeline")
          and not r.get("retries")]
    if not ok:
        return {}
    out = {k: float(np.median([r["timeline"][k] for r in ok]))
           for k in ("queued_ms", "prefill_ms", "kv_transfer_ms", "first_token_ms")}
    out["client_ttft_ms"] = float(np.median([1000 * (r["token_times"][0] - r["sent"]) for r in ok]))
    out["client_minus_gateway_ttft_ms"] = float(np.median(
        [1000 * (r["token_times"][0] - r["sent"]) - r["timeline"]["first_token_ms"] for r in ok]))
    out["requests"] = len(ok)
    return out


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
