"""Long fuzz of the public API: hypothesis-built requests (the strategies of tests/harness/fuzz_api.py)
against a real stack, counting answers per RPC and status code instead of stopping at the first bad one.

Starts its own stack (Redis + gateway + prefill + decode on loopback; by default the tiny
test Llama with a chat template that refuses some conversations) or attaches to ``--address``.
Runs rounds of ``--round-size`` examples with fresh seeds until ``--examples`` or
``--minutes`` is reached. Every answer must be OK or a client error (INVALID_ARGUMENT,
NOT_FOUND, OUT_OF_RANGE, RESOURCE_EXHAUSTED, FAILED_PRECONDITION, ALREADY_EXISTS); the others
are listed with up to ``--keep`` example requests each. After every round: health and (own
stack) every process alive; at the end (own stack): KV pages back at baseline, no live request
in Redis, and the ERROR lines of the stack's logs grouped by message.

    python -m bench.fuzz --minutes 5 --out bench/results/fuzz.json
    python -m bench.fuzz --address localhost:50051 --examples 500
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, seed, settings

from bench.common import write_json
from splitserve.v1 import generation_pb2_grpc


def tiny_fuzz_model(root: Path) -> Path:
    from tests.harness.fuzz_api import CHAT_TEMPLATE
    from tests.harness.tiny_models import make_tiny_model
    path = make_tiny_model(root / "llama")
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


def log_errors(log_paths: dict, levels=("ERROR", "CRITICAL")) -> dict[str, dict[str, int]]:
    """Lines of ``levels`` in each process's JSON log, counted by message (+ exception type);
    request ids in messages are kept, so for WARNINGs the keys are often one request each."""
    out: dict[str, dict[str, int]] = {}
    for name, path in log_paths.items():
        counts: Counter = Counter()
        for line in Path(path).read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("level") in levels:
                exc = entry.get("exception", "").strip().splitlines()
                counts[f"{entry.get('message')} | {exc[-1] if exc else ''}"[:300]] += 1
        if counts:
            out[name] = dict(counts.most_common())
    return out


def healthy(channel) -> bool:
    try:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="splitserve.v1.Generation"), timeout=10).status
        return status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="", help="fuzz a running gateway instead of starting a stack")
    p.add_argument("--model", default="", help="model for the own stack (default: the tiny test Llama)")
    p.add_argument("--examples", type=int, default=1000)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--round-size", type=int, default=50)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--keep", type=int, default=3, help="example requests kept per unexpected (rpc, status)")
    p.add_argument("--out", default="bench/results/fuzz.json")
    args = p.parse_args(argv)

    from tests.harness.fuzz_api import ALLOWED, call, describe, requests
    master_seed = args.seed if args.seed is not None else random.randrange(2**32)
    stack, workdir = None, None
    if args.address:
        address = args.address
    else:
        from tests.harness.stack import start_stack
        workdir = Path(tempfile.mkdtemp(prefix="ss-fuzz-"))
        model = args.model or tiny_fuzz_model(workdir / "models")
        print(f"starting a stack of {model} (logs in {workdir / 'stack'})", flush=True)
        stack = start_stack(model, workdir / "stack", prefill=1, decode=1, worker_args=["--num-threads", "1"])
        address = stack.gateway_address
        baseline = stack.free_pages()
    channel = grpc.insecure_channel(address)
    stub = generation_pb2_grpc.GenerationStub(channel)

    counts: dict[str, Counter] = defaultdict(Counter)
    unexpected: dict[str, list[str]] = defaultdict(list)
    checks: dict = {"health_failures": 0, "dead_processes": {}}
    start, done, rounds = time.monotonic(), 0, 0
    try:
        while done < args.examples and time.monotonic() - start < args.minutes * 60:
            n = min(args.round_size, args.examples - done)
            round_seed = master_seed + rounds

            @seed(round_seed)
            @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(item=requests())
            def body(item):
                rpc, request = item
                code, details = call(stub, rpc, request)
                counts[rpc][code + (" (cut)" if details == "cut by the client" else "")] += 1
                if code not in ALLOWED:
                    key = f"{rpc} {code}: {details}"[:300]
                    if len(unexpected[key]) < args.keep:
                        unexpected[key].append(describe(rpc, request))
            body()
            rounds += 1
            done = sum(sum(c.values()) for c in counts.values())
            if not healthy(channel):
                checks["health_failures"] += 1
            if stack is not None:
                dead = {name: proc.returncode for name, proc in stack.procs.items() if proc.poll() is not None}
                checks["dead_processes"].update(dead)
            bad = sum(c for rpc in counts.values() for code, c in rpc.items() if code.split()[0] not in ALLOWED)
            print(f"round {rounds}: {done} examples, {bad} unexpected answers, "
                  f"{time.monotonic() - start:.0f} s", flush=True)
        wall = time.monotonic() - start
        checks["healthy_at_end"] = healthy(channel)
        if stack is not None:
            from tests.harness.stack import wait_pages_at_baseline, wait_redis_clean
            try:
                wait_pages_at_baseline(stack, baseline, timeout_s=60)
                checks["pages_at_baseline"] = True
            except AssertionError as e:
                checks["pages_at_baseline"] = str(e)
            checks["pages"] = {"baseline": baseline, "end": stack.free_pages()}
            live, queues = wait_redis_clean(stack.redis, 60)
            checks["live_request_keys"] = live
            checks["queued"] = queues
            checks["log_errors"] = log_errors(stack.log_paths)
    finally:
        channel.close()
        if stack is not None:
            stack.close()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)

    total_unexpected = sum(c for rpc in counts.values() for code, c in rpc.items() if code.split()[0] not in ALLOWED)
    summary = {
        "examples": done, "rounds": rounds, "wall_s": round(wall, 1), "examples_per_s": round(done / wall, 2),
        "unexpected_answers": total_unexpected,
        "by_rpc_and_status": {rpc: dict(c.most_common()) for rpc, c in sorted(counts.items())},
        "by_status": dict(sum(counts.values(), Counter()).most_common()),
    }
    write_json(args.out, {
        "benchmark": "fuzz",
        "config": {**vars(args), "seed": master_seed, "model": args.model or ("(attached)" if args.address
                                                                             else "tiny test llama")},
        "summary": summary, "unexpected": dict(unexpected), "checks": checks,
    })
    print(json.dumps(summary, indent=2))
    if unexpected:
        print("\nunexpected answers:")
        for key, examples in unexpected.items():
            print(f"  {key}\n    e.g. {examples[0][:300]}")
    ok = not total_unexpected and checks.get("healthy_at_end") and not checks["dead_processes"] \
        and checks.get("pages_at_baseline", True) is True and not checks.get("live_request_keys")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
