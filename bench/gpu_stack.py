"""``splitserve up`` on one device, for the device check: started, waited for, stopped.

``serving_under_load`` is issue 37's point 5: the whole stack (Redis, gateway, a prefill and a
decode worker sharing one GPU, KV over cuda_ipc) on Llama-3.1-8B's shape with random weights
(``--load-format dummy``), driven by ``splitserve.cli.loadgen`` at three rates: TTFT p50/p99,
TPOT p50 and the KV transfer time per request from each request's own timeline. The GPU machine
carries no HTTP packages, so the load goes over gRPC (the same gateway and path behind both).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def running_up(args: Sequence[str], limit_s: float, env: dict | None = None) -> Iterator[tuple[str, list[str]]]:
    """``splitserve up <args>`` until its "is up" line (within ``limit_s``); yields (gRPC address,
    the lines it printed) or raises RuntimeError with the log's tail; SIGTERM when done."""
    from splitserve.common.processes import free_port
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    cmd = [sys.executable, "-m", "splitserve.cli", "up", *args, "--port", str(port), "--metrics-port", "0",
           "--http-port", "-1"]  # the HTTP API's packages are not carried to the GPU machine
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + limit_s
        for line in proc.stdout:
            lines.append(line.rstrip())
            if "splitserve is up" in line or time.monotonic() > deadline:
                break
        if not any("splitserve is up" in line for line in lines):
            raise RuntimeError("the stack did not come up:\n" + "\n".join(lines[-40:]))
        yield f"127.0.0.1:{port}", lines
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serving_under_load(model_dir: Path, device: str, rates: Sequence[float], num_requests: int, vocab_size: int,
                       limit_s: float, extra: Sequence[str] = ()) -> dict:
    """The stack on ``model_dir`` at each rate in turn (Poisson arrivals, the ``mixed`` workload)."""
    from splitserve.cli.loadgen import GrpcBackend, run_load, summarize, timeline_breakdown
    from splitserve.cli.workloads import fresh_tokens, mixed, poisson_offsets
    args = ["--model", str(model_dir), "--device", device, "--load-format", "dummy", "--prefill", "1",
            "--decode", "1", *extra]
    started = time.monotonic()
    with running_up(args, limit_s) as (address, lines):
        up_s = time.monotonic() - started
        backend = GrpcBackend(address)
        try:
            base = mixed(num_requests, vocab_size, seed=0)
            run_load(backend, base[:2], [0.0, 0.0])  # warm-up: first steps, first transfer
            points = []
            for i, rate in enumerate(rates):
                requests = fresh_tokens(base, vocab_size, seed=i + 1)
                results, wall = run_load(backend, requests, poisson_offsets(len(requests), rate, seed=i))
                summary = summarize(results, wall, float("inf"), float("inf"))
                points.append({"rate": rate, "requests": len(requests), "failed": summary["failed"],
                               "errors": summary["errors"], "ttft_ms": summary["ttft_ms"],
                               "tpot_ms": summary["tpot_ms"], "output_tokens_per_s": summary["output_tokens_per_s"],
                               "timeline_p50_ms": timeline_breakdown(results)})
        finally:
            backend.close()
    return {"ok": all(p["failed"] == 0 for p in points), "up_s": up_s, "points": points,
            "up_says": [line for line in lines if "worker" in line.lower()][:8], "api": "gRPC"}
