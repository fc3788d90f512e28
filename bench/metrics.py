"""What the serving benchmarks measure, defined once (bench/serve.py, bench/plots.py, bench/compare.py)."""
from __future__ import annotations

DEFINITIONS = ("vLLM benchmark_serving: TTFT = sent -> first token; TPOT = (E2E - TTFT) / (tokens - 1) per "
               "request; ITL = gaps between streamed tokens, pooled; E2E = sent -> last token; ms")
# The aim of issue 7 at 2 req/s mixed Poisson through the whole stack. "goodput_aim" counts
# requests that meet both as per-request SLOs.
AIM = {"ttft_p99_ms": 100.0, "tpot_p50_ms": 32.0}


def metric_values(records: list[dict], metric: str, kind: str | None = None) -> list[float]:
    """Per-request (ttft, tpot, e2e) or per-gap (itl) values in ms of the completed requests."""
    ok = [r for r in records if r["error"] is None and r["token_times"] and (kind is None or r["kind"] == kind)]
    if metric == "ttft":
        return [1000 * (r["token_times"][0] - r["sent"]) for r in ok]
    if metric == "e2e":
        return [1000 * (r["token_times"][-1] - r["sent"]) for r in ok]
    if metric == "tpot":
        return [1000 * (r["token_times"][-1] - r["token_times"][0]) / (len(r["token_times"]) - 1)
                for r in ok if len(r["token_times"]) > 1]
    if metric == "itl":
        return [1000 * (b - a) for r in ok for a, b in zip(r["token_times"], r["token_times"][1:])]
    raise ValueError(f"unknown metric {metric!r}")
