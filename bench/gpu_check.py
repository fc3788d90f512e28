"""``make gpu-check``: splitserve's whole GPU path, run once on one GPU, written to one JSON file.

Prepared for a machine with one GPU (an H200 here), Python 3.12 with torch, triton and
transformers, and no network: what it lacks travels in ``.gpu-carry/`` (``make gpu-carry``, see
``bench/gpu_carry.py``). Steps, most telling first; each is bounded, a failing step is recorded
with its error and the next one runs, and a step is skipped when the whole run (``--budget-s``,
under 8 minutes) could not finish it:

1. ``pytest_gpu`` -- the ``gpu``-marked tests, Triton compiled (TRITON_INTERPRET=0): kernels vs
   their torch reference, the engine on CUDA vs transformers (CUDA graphs included), cuda_ipc
   between processes, checksums, page copies, memory shares; two-GPU tests skip on one GPU.
2. ``roofline`` -- ``bench.roofline``: a Llama-3.1-8B-shaped model (random bf16 weights, built from
   its config on the GPU), decode step time at batch 1/16/64/256 x context 1,024/4,096 and prefill
   at 512/4,096 tokens, each as a fraction of the roofline from this GPU's measured copy bandwidth
   and bf16 matmul rate.
3. ``kvtransfer_cuda_ipc`` -- ``bench.kvtransfer`` with both pools on the GPU: a prefill process
   writing SmolLM2-shaped KV pages into a decode pool through CUDA IPC vs a device-to-device copy.
3b. ``stack_8b`` -- ``bench.gpu_stack``: ``splitserve up`` on the 8B shape (random weights), a
   prefill and a decode worker sharing the GPU, the ``mixed`` workload at 1, 4 and 16 requests/s
   over gRPC: TTFT p50/p99, TPOT p50, KV transfer ms per request.
4. ``engine_exact`` -- a SmolLM2-shaped random model, fp32, compiled step with CUDA graphs for
   decode, greedy output token for token against transformers on the same GPU.
5. ``triton_decode_bandwidth`` -- KV bytes/s of the Triton decode kernels vs a device copy;
   ``triton_prefill_attention`` -- TFLOP/s of the Triton prefill kernel over paged KV at 4,096
   tokens on the 8B attention shape (whole, and after a 2,048-token cached prefix).
6. ``stack`` -- ``splitserve up --device cuda``: Redis, gateway, a prefill and a decode worker
   sharing the GPU (``--gpu-memory-utilization``), one streamed request; the prefill worker's
   metrics say which transport carried the KV.
7. ``decode_throughput`` -- engine decode tokens/s at batch 1/16/64/256 (bf16, CUDA graphs).
8. ``engine_tp1`` -- ``engine_exact``'s check (fewer prompts) with ``tensor_parallel_size=1`` passed
   explicitly: the one-GPU path of a tensor-parallel engine stays exact; the JSON records the size
   the engine ran with and how many GPUs were visible.

Tensor parallelism above 1 needs 2+ GPUs and is not run by this one-GPU check. On such a box it
would be checked with the same tools: (a) ``engine_exact`` with ``tensor_parallel_size=2`` on a
tiny model with GQA whose heads divide by 2 (e.g. 8 query / 4 KV heads, fp32): greedy output token
for token equal to the same model at ``tensor_parallel_size=1`` and to transformers (a mismatch
with a near-zero top-2 margin is a tie broken by the all-reduce's summation order, not a bug);
(b) ``stack`` with ``--tensor-parallel-size 2`` and a prefill and a decode worker on disjoint GPU
pairs (``--device cuda:0`` and ``cuda:2`` on 4 GPUs): one streamed request, greedy-equal to the
TP=1 stack, with the prefill's metrics showing the KV moved rank to rank (``cuda_ipc``); and (c) a
prefill TP=2 against a decode TP=1 worker, which must be refused at the handoff, not served.

    make gpu-check                                    # writes bench/results/gpu_check.json
    python -m bench.gpu_check --out gpu_check.json --steps engine_exact,stack
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

from bench.common import write_json

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".gpu-carry"
# Only the test files with gpu-marked tests: the others import what the GPU machine lacks
# (hypothesis, psutil, ...) and would fail to collect.
GPU_TESTS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if "mark.gpu" in p.read_text())
# Seconds each step is allowed (and, before it starts, needs to be left of the budget).
# In the order they run: decode_throughput (the step time with and without async scheduling, two
# engines compiled) early, so a long run still measures it.
STEP_LIMITS = {"pytest_gpu": 180, "decode_throughput": 120, "roofline": 200, "kvtransfer_cuda_ipc": 60, "stack_8b": 220,
               "stack_8b_two_gpus": 220, "engine_exact": 100, "triton_decode_bandwidth": 30,
               "triton_prefill_attention": 30, "stack": 120, "engine_tp1": 100}


def versions() -> dict:
    import importlib.metadata

    import torch
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    for name in ("triton", "transformers", "grpcio", "protobuf", "redis"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def pytest_gpu(limit_s: float) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-m", "gpu", "-p", "no:cacheprovider", "--timeout", "120",
           *GPU_TESTS]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired as e:  # keep what it printed: which tests ran, which hung
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"ok": False, "error": f"pytest ran past {limit_s} s", "output_tail": out[-6000:]}
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", summary)}
    return {"ok": proc.returncode == 0, "summary": summary, "counts": counts,
            "output_tail": (proc.stdout + proc.stderr)[-6000:]}


def roofline(device: str) -> dict:
    """``bench.roofline`` on the 8B shape (on a CPU rehearsal: its tiny shape, eager)."""
    from bench import roofline as bench_roofline
    if device == "cuda":
        argv = ["--shape", "llama-3.1-8b", "--device", "cuda"]
    else:
        argv = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--mode", "eager", "--batches", "1,2",
                "--contexts", "32,64", "--prefill", "32,64", "--steps", "3", "--prefill-iters", "1",
                "--copy-mib", "16", "--matmul-n", "128", "--kv-gb-cpu", "0.05"]
    return bench_roofline.run(bench_roofline.parser().parse_args(argv))


def kvtransfer_cuda_ipc(device: str) -> dict:
    from bench.kvtransfer import run
    rows = run(["cuda_ipc" if device == "cuda" else "shm"], [512, 4096], ["contiguous", "fragmented", "scattered"],
               repeats=5, device=device)
    return {"ok": bool(rows), "rows": rows,
            "baseline": "torch copy of the same bytes on the same device, interleaved"}


def stack(model_dir: Path, limit_s: float, device: str = "cuda") -> dict:
    """``splitserve up --device cuda`` with a prefill and a decode worker on this GPU, one streamed request."""
    from bench.gpu_stack import running_up
    from splitserve.client import Client
    args = ["--model", str(model_dir), "--device", device, "--dtype", "bfloat16", "--prefill", "1", "--decode", "1"]
    args += ["--gpu-memory-utilization", "0.3"] if device == "cuda" else ["--num-gpu-blocks", "256"]
    expected = "cuda_ipc" if device == "cuda" else "shm"
    with running_up(args, limit_s - 30, env={"SPLITSERVE_ENFORCE_EAGER": "1"}) as (address, _):  # compiled: engine_exact
        with Client(address) as client:
            sent = time.perf_counter()
            events, first = [], None
            for event in client.generate("The capital of France is", max_tokens=32, temperature=0.0,
                                         ignore_eos=True, timeout=60):
                first = first or time.perf_counter()
                events.append(event)
            info = client.server_info()
        final = events[-1]
        transports = {}
        for worker in info.workers:
            if worker.role == "prefill" and worker.metrics_address:
                text = urllib.request.urlopen(f"http://{worker.metrics_address}/metrics", timeout=5).read().decode()
                for name, value in re.findall(  # model_name is among the labels too
                        r'^splitserve:kv_transfer_bytes_total\{[^}]*\btransport="(\w+)"[^}]*\} (\S+)$', text, re.M):
                    transports[name] = float(value)
        chunks = sum(1 for e in events if not e.finished)
        return {"ok": final.finish_reason == "length" and final.usage.completion_tokens == 32
                and transports.get(expected, 0) > 0,
                "finish_reason": final.finish_reason, "completion_tokens": final.usage.completion_tokens,
                "streamed_chunks": chunks, "client_ttft_ms": 1000 * (first - sent),
                "timeline": {"first_token_ms": final.timeline.first_token_ms, "prefill_ms": final.timeline.prefill_ms,
                             "kv_transfer_ms": final.timeline.kv_transfer_ms, "decode_ms": final.timeline.decode_ms},
                "kv_transfer_bytes_by_transport": transports, "text": "".join(e.text for e in events)}


def stack_8b(workdir: Path, limit_s: float, device: str, two_gpus: bool = False) -> dict:
    """The stack under load on the 8B shape (a CPU rehearsal: the tiny shape, two low rates);
    ``two_gpus``: the prefill worker on cuda:0, the decode worker on cuda:1 (each its GPU's 0.85)."""
    import torch

    from bench import gpu_stack, roofline
    if device == "cuda":
        if two_gpus and torch.cuda.device_count() < 2:
            return {"ok": None, "skipped": f"needs two GPUs, {torch.cuda.device_count()} visible"}
        model = roofline.model_dir("llama-3.1-8b", workdir)
        place = ["--prefill-device", "cuda:0", "--decode-device", "cuda:1", "--gpu-memory-utilization", "0.85"] \
            if two_gpus else ["--gpu-memory-utilization", "0.42"]
        return gpu_stack.serving_under_load(model, "cuda", [1.0, 4.0, 16.0], 32, 256, limit_s - 70,
                                            ["--dtype", "bfloat16", *place])
    model = roofline.model_dir("tiny", workdir)
    place = ["--prefill-device", "cpu", "--decode-device", "cpu"] if two_gpus else []
    return gpu_stack.serving_under_load(model, "cpu", [1.0, 4.0], 6, 256, limit_s - 30,
                                        ["--dtype", "float32", "--num-gpu-blocks", "256", *place])


def engine_tp1(model_dir: Path, device: str) -> dict:
    """``engine_exact`` with tensor_parallel_size=1 given explicitly (the default path, one GPU)."""
    import torch

    from bench import gpu_probes
    outcome = gpu_probes.engine_exact(model_dir, num_prompts=4, device=device, tensor_parallel_size=1)
    outcome["ok"] = outcome["ok"] and outcome["tensor_parallel_size"] == 1
    outcome["visible_gpus"] = torch.cuda.device_count()
    outcome["tensor_parallel_above_1"] = "not run by this one-GPU check; the docstring of bench/gpu_check.py says how"
    return outcome


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_check.json"))
    parser.add_argument("--budget-s", type=float, default=480, help="the whole run (steps that would not fit skip)")
    parser.add_argument("--steps", default=",".join(STEP_LIMITS))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a rehearsal of the script itself on a machine without a GPU (shm instead of "
                             "cuda_ipc, no Triton step, eager engine)")
    args = parser.parse_args(argv)
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu-check needs a CUDA device (--device cpu rehearses the script without one)")
    from bench import gpu_probes
    start = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="splitserve-gpu-check-"))
    result: dict = {"benchmark": "gpu_check", "device": args.device, "versions": versions(), "steps": {}}
    model_dir = gpu_probes.build_model(workdir / "smollm2-random", CARRY / "smollm2", device=args.device)
    result["model"] = {"shape": "SmolLM2-135M, random weights", "built_s": time.monotonic() - start}
    steps = {
        "pytest_gpu": lambda limit: pytest_gpu(limit),
        "roofline": lambda limit: roofline(args.device),
        "kvtransfer_cuda_ipc": lambda limit: kvtransfer_cuda_ipc(args.device),
        "engine_exact": lambda limit: gpu_probes.engine_exact(model_dir, device=args.device),
        "triton_decode_bandwidth": lambda limit: gpu_probes.triton_decode_bandwidth(),
        "triton_prefill_attention": lambda limit: gpu_probes.triton_prefill_attention(),
        "stack": lambda limit: stack(model_dir, limit, args.device),
        "stack_8b": lambda limit: stack_8b(workdir, limit, args.device),
        "stack_8b_two_gpus": lambda limit: stack_8b(workdir, limit, args.device, two_gpus=True),
        "decode_throughput": lambda limit: (gpu_probes.decode_throughput(model_dir) if args.device == "cuda" else
                                            gpu_probes.decode_throughput(model_dir, (1, 4), 64, 3, "eager")),
        "engine_tp1": lambda limit: engine_tp1(model_dir, args.device),
    }
    for name in args.steps.split(","):
        left = args.budget_s - (time.monotonic() - start)
        if name.startswith("triton_") and args.device != "cuda":
            result["steps"][name] = {"ok": None, "skipped": "compiled Triton needs CUDA"}
            continue
        if left < STEP_LIMITS[name]:
            result["steps"][name] = {"ok": None, "skipped": f"{left:.0f} s of the budget left, the step may take "
                                                            f"{STEP_LIMITS[name]} s"}
            continue
        step_start = time.monotonic()
        print(f"[gpu-check] {name} ...", flush=True)
        try:
            outcome = steps[name](STEP_LIMITS[name])
        except Exception as e:  # one broken step must not hide what the others find
            outcome = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        outcome["seconds"] = time.monotonic() - step_start
        result["steps"][name] = outcome
        print(f"[gpu-check] {name}: ok={outcome.get('ok')} in {outcome['seconds']:.0f} s", flush=True)
    result["total_s"] = time.monotonic() - start
    write_json(args.out, result)
    failed = [n for n, s in result["steps"].items() if s.get("ok") is False]
    print(f"[gpu-check] done in {result['total_s']:.0f} s; failed: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
