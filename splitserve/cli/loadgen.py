"""An open-loop load generator for a running gateway, and the serving metrics it reports.

Metrics follow vLLM's definitions (benchmark_serving): TTFT = request sent -> first token
received; TPOT = (E2E - TTFT) / (output tokens - 1) per request; ITL = every gap between
consecutive streamed tokens, pooled; E2E = sent -> last token. Throughput = output tokens /
wall time. Goodput = requests meeting every SLO per second.

A *backend* is anything with ``stream(request, meta) -> iterator of token-id lists``
(``GrpcBackend`` here; the benchmarks add an OpenAI-HTTP one and the in-process engine);
``run_load`` sends requests at given offsets and records when every token arrives;
``summarize`` turns those records into the metrics above. ``splitserve tune`` and the
benchmarks (bench/serve.py, bench/compare.py) share it.
"""
from __future__ import annotations

import threading
import time
from typing import Iterator, Protocol, Sequence

import numpy as np

from splitserve.cli.workloads import BenchRequest


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
