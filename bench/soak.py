"""Soak test: minutes of mixed traffic with cancels and deadlines against a whole stack, sampling
the memory (RSS) of every process and the free KV pages of every worker over time.

Starts the processes ``splitserve up`` starts (Redis, gateway, one prefill and one decode
worker; the default model, ``up``'s engine defaults and thread split) or attaches to a running
gateway with ``--address`` (processes are found by their listening ports; Redis only with
``--redis-url``). Traffic: Poisson arrivals at ``--rate`` requests/s; each request is, at
random, run to its end (greedy or sampled, token ids or a chat prompt), cancelled by the client
after a random delay, aborted by id, or sent with a short deadline. Every ``--interval`` seconds
it samples RSS per process (psutil), free/total pages, running/waiting per worker and the queue
depth. After the traffic it lets the stack settle (bounded) and checks pages against the
baseline and Redis for live requests.

    python -m bench.soak --minutes 3 --out bench/results/soak.json --png bench/results/soak.png
    python -m bench.soak --address localhost:50051 --minutes 10

Summary: RSS start/end/max and growth per process (also from the end of the warm-up, the first
``--warmup-frac`` of the run, which is where a leak shows), pages baseline vs end, requests by
kind and outcome, TTFT/E2E percentiles of completed requests.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import psutil

from bench.common import write_json
from splitserve.v1 import generation_pb2, generation_pb2_grpc

KINDS = {"complete": 0.6, "cancel": 0.2, "deadline": 0.15, "abort": 0.05}
MIB = 2**20


# ---- processes --------------------------------------------------------------------------------

def pids_by_port(ports: set[int]) -> dict[int, int]:
    """port -> pid of the process listening on it (this machine only)."""
    out = {}
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port in ports and conn.pid:
            out[conn.laddr.port] = conn.pid
    return out


def attach_processes(stub, address: str, redis_url: str) -> tuple[dict[str, int], dict[str, str]]:
    """(name -> pid, worker name -> address) of a running stack, found by listening port."""
    info = stub.GetServerInfo(generation_pb2.GetServerInfoRequest(), timeout=10)
    workers, counts = {}, Counter()
    for w in info.workers:
        if w.role == "gateway":
            continue
        counts[w.role] += 1
        workers[f"{w.role}{counts[w.role] - 1}"] = w.address
    ports = {int(address.rsplit(":", 1)[1]): "gateway"}
    ports.update({int(a.rsplit(":", 1)[1]): name for name, a in workers.items()})
    if redis_url:
        from urllib.parse import urlparse
        ports[urlparse(redis_url).port or 6379] = "redis"
    found = pids_by_port(set(ports))
    return {ports[port]: pid for port, pid in found.items()}, workers


# ---- traffic ----------------------------------------------------------------------------------

class Traffic:
    """Poisson arrivals; one thread per request; outcomes counted by kind."""

    def __init__(self, stub, vocab_size: int, rate: float, seed: int, max_tokens: int, max_in_flight: int,
                 chat_frac: float = 0.3):
        self.stub, self.vocab_size, self.rate, self.chat_frac = stub, vocab_size, rate, chat_frac
        self.rng = random.Random(seed)
        self.max_tokens, self.max_in_flight = max_tokens, max_in_flight
        self.outcomes: Counter = Counter()
        self.unexpected: list[str] = []
        self.ttft: list[float] = []
        self.e2e: list[float] = []
        self.tokens = 0
        self.sent = self.skipped = 0
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._n = 0

    def in_flight(self) -> int:
        return sum(t.is_alive() for t in self.threads)

    def run(self, seconds: float, stop: threading.Event) -> None:
        end = time.monotonic() + seconds
        while not stop.is_set():
            wait = self.rng.expovariate(self.rate)
            if time.monotonic() + wait > end or stop.wait(wait):
                return
            self.threads = [t for t in self.threads if t.is_alive()]
            if len(self.threads) >= self.max_in_flight:
                self.skipped += 1  # the stack is far behind: do not pile up client threads
                continue
            item = self._plan()
            t = threading.Thread(target=self._one, args=(item,), daemon=True)
            t.start()
            self.threads.append(t)
            self.sent += 1

    def _plan(self) -> dict:
        rng = self.rng
        self._n += 1
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        sampling = {"max_tokens": rng.randint(4, self.max_tokens)}
        if rng.random() < 0.5:
            sampling.update(temperature=0.0)
        else:
            sampling.update(temperature=0.8, top_p=0.95, top_k=rng.choice([0, 50]), seed=rng.randrange(2**32))
        request = generation_pb2.GenerateRequest(request_id=f"soak-{os.getpid()}-{self._n}",
                                                 priority=rng.randint(0, 2), stream_interval=rng.choice([1, 4]),
                                                 sampling=generation_pb2.SamplingParams(**sampling))
        if rng.random() < self.chat_frac:
            request.messages.add(role="user", content=" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))))
        else:
            low = min(100, self.vocab_size // 2)
            request.token_ids.extend(rng.randrange(low, self.vocab_size) for _ in range(rng.randint(8, 256)))
        return {"kind": kind, "request": request, "cut_s": rng.uniform(0.05, 3.0)}

    def _one(self, item: dict) -> None:
        kind, request = item["kind"], item["request"]
        timeout = item["cut_s"] if kind == "deadline" else 600.0
        sent = time.monotonic()
        call = self.stub.Generate(request, timeout=timeout)
        timer = None
        if kind == "cancel":
            timer = threading.Timer(item["cut_s"], call.cancel)
        elif kind == "abort":
            timer = threading.Timer(item["cut_s"], self._abort, args=(request.request_id,))
        if timer is not None:
            timer.start()
        first, n = None, 0
        try:
            for response in call:
                if response.HasField("chunk") and response.chunk.token_ids:
                    first = first or time.monotonic()
                    n += len(response.chunk.token_ids)
            outcome = "OK"
        except grpc.RpcError as e:
            outcome = e.code().name
            expected = {"cancel": "CANCELLED", "abort": "CANCELLED", "deadline": "DEADLINE_EXCEEDED"}.get(kind)
            if outcome != expected:
                with self._lock:
                    self.unexpected.append(f"{request.request_id} ({kind}): {outcome} {e.details()!r}")
        finally:
            if timer is not None:
                timer.cancel()
        with self._lock:
            self.outcomes[f"{kind}:{outcome}"] += 1
            self.tokens += n
            if outcome == "OK" and first is not None:
                self.ttft.append(first - sent)
                self.e2e.append(time.monotonic() - sent)

    def _abort(self, request_id: str) -> None:
        try:
            self.stub.Abort(generation_pb2.AbortRequest(request_id=request_id), timeout=10)
        except grpc.RpcError as e:
            with self._lock:
                self.unexpected.append(f"Abort({request_id}): {e.code().name} {e.details()!r}")


WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "explain why sky blue write poem about rust memory safety list three prime numbers").split()


# ---- sampling ---------------------------------------------------------------------------------

def worker_infos(workers: dict[str, str]) -> dict[str, dict]:
    from tests.harness.stack import worker_info
    out = {}
    for name, address in workers.items():
        try:
            i = worker_info(address, timeout_s=5)
            out[name] = {"free": i.kv_blocks_free, "total": i.kv_blocks_total, "cached": i.kv_blocks_cached,
                         "running": i.num_running, "waiting": i.num_waiting}
        except grpc.RpcError as e:
            out[name] = {"error": e.code().name}
    return out


def sample(t0: float, pids: dict[str, int], workers: dict[str, str], stub, traffic: Traffic) -> dict:
    # rss counts shared memory too: the decode worker's KV pool is shared memory (shm transport)
    # that the prefill worker maps and writes, so both grow as pool pages are first touched (the
    # free list is FIFO). anon = rss - shared (file-backed + shmem) is where a leak shows.
    rss, anon = {}, {}
    for name, pid in pids.items():
        try:
            mem = psutil.Process(pid).memory_info()
            rss[name], anon[name] = mem.rss, mem.rss - getattr(mem, "shared", 0)
        except psutil.Error:
            rss[name] = anon[name] = None
    try:
        depth = stub.GetServerInfo(generation_pb2.GetServerInfoRequest(), timeout=5).queue_depth
    except grpc.RpcError:
        depth = None
    return {"t": round(time.monotonic() - t0, 2), "rss": rss, "anon": anon, "workers": worker_infos(workers),
            "queue_depth": depth, "in_flight": traffic.in_flight(), "done": sum(traffic.outcomes.values())}


def pct(values: list[float]) -> dict:
    if not values:
        return {}
    a = np.asarray(values) * 1000
    return {"p50": round(float(np.percentile(a, 50)), 1), "p90": round(float(np.percentile(a, 90)), 1),
            "p99": round(float(np.percentile(a, 99)), 1)}


def summarize(samples: list[dict], warmup_frac: float, key: str = "rss") -> dict:
    out = {}
    names = sorted({n for s in samples for n in s[key]})
    warm = next((s for s in samples if s["t"] >= samples[-1]["t"] * warmup_frac), samples[0])
    for name in names:
        series = [s[key].get(name) for s in samples if s[key].get(name)]
        if not series:
            continue
        w = warm[key].get(name) or series[0]
        out[name] = {"start_mib": round(series[0] / MIB, 1), "after_warmup_mib": round(w / MIB, 1),
                     "end_mib": round(series[-1] / MIB, 1), "max_mib": round(max(series) / MIB, 1),
                     "growth_mib": round((series[-1] - series[0]) / MIB, 1),
                     "growth_after_warmup_mib": round((series[-1] - w) / MIB, 1)}
    return out


def plot(samples: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    t = [s["t"] for s in samples]
    for name in sorted({n for s in samples for n in s["rss"]}):
        line, = a.plot(t, [(s["rss"].get(name) or np.nan) / MIB for s in samples], label=f"{name} rss")
        a.plot(t, [(s.get("anon", {}).get(name) or np.nan) / MIB for s in samples], "--", color=line.get_color(),
               label=f"{name} anon")
    a.set_ylabel("RSS (MiB)")
    a.legend(loc="upper left", fontsize=8)
    for name in sorted({n for s in samples for n in s["workers"]}):
        b.plot(t, [s["workers"].get(name, {}).get("free", np.nan) for s in samples], label=f"{name} free pages")
    b.set_ylabel("free KV pages")
    b.set_xlabel("seconds")
    b.legend(loc="lower left", fontsize=8)
    c = b.twinx()
    c.plot(t, [s["in_flight"] for s in samples], "k:", label="requests in flight")
    c.set_ylabel("requests in flight")
    c.legend(loc="lower right", fontsize=8)
    fig.suptitle("soak: memory and KV pages over time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


# ---- main -------------------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="", help="attach to a running gateway instead of starting a stack")
    p.add_argument("--redis-url", default="", help="with --address: also sample this Redis's RSS")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-in-flight", type=int, default=64)
    p.add_argument("--chat-frac", type=float, default=0.3,
                   help="share of chat-message prompts (0 for a model without a chat template)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--warmup-frac", type=float, default=0.2)
    p.add_argument("--settle-s", type=float, default=120.0, help="bound on the wait for the stack to go idle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker flag (own stack), repeatable")
    p.add_argument("--out", default="bench/results/soak.json")
    p.add_argument("--png", default="")
    args = p.parse_args(argv)

    stack = None
    if args.address:
        address = args.address
    else:
        from tests.harness.stack import start_stack
        threads = max(1, (os.cpu_count() or 2) // 2)  # as `splitserve up` splits the cores
        log_dir = Path(tempfile.mkdtemp(prefix="ss-soak-"))
        print(f"starting a stack of {args.model} (logs in {log_dir})", flush=True)
        stack = start_stack(args.model, log_dir, prefill=1, decode=1, worker_defaults=(),
                            worker_args=["--num-threads", str(threads), *args.worker_arg], metrics=False)
        address = stack.gateway_address
    channel = grpc.insecure_channel(address)
    stub = generation_pb2_grpc.GenerationStub(channel)
    if stack is not None:
        pids = {name: proc.pid for name, proc in stack.procs.items()}
        pids["redis"] = stack.redis.proc.pid
        workers = dict(stack.addresses)
    else:
        pids, workers = attach_processes(stub, address, args.redis_url)
    model_info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    baseline = {name: w.get("free") for name, w in worker_infos(workers).items()}
    traffic = Traffic(stub, model_info.vocab_size, args.rate, args.seed, args.max_tokens, args.max_in_flight,
                      args.chat_frac)
    samples: list[dict] = []
    stop = threading.Event()
    t0 = time.monotonic()
    checks: dict = {}
    try:
        driver = threading.Thread(target=traffic.run, args=(args.minutes * 60, stop), daemon=True)
        driver.start()
        next_sample = t0
        while driver.is_alive():
            if time.monotonic() >= next_sample:
                samples.append(sample(t0, pids, workers, stub, traffic))
                s = samples[-1]
                print(f"t={s['t']:6.0f}s done={s['done']} in_flight={s['in_flight']} queue={s['queue_depth']} "
                      f"rss(MiB)={ {k: round(v / MIB) for k, v in s['rss'].items() if v} } "
                      f"free={ {k: w.get('free') for k, w in s['workers'].items()} }", flush=True)
                next_sample += args.interval
            driver.join(min(1.0, max(0.0, next_sample - time.monotonic())))
        traffic_s = time.monotonic() - t0
        # Settle: the last requests end (bounded), then the pages must be back.
        give_up = time.monotonic() + args.settle_s
        for t in list(traffic.threads):
            t.join(max(0.0, give_up - time.monotonic()))
        checks["requests_still_open_after_settle"] = traffic.in_flight()
        while time.monotonic() < give_up:
            infos = worker_infos(workers)
            if all(infos[n].get("free") == baseline[n] and not infos[n].get("running")
                   and not infos[n].get("waiting") for n in workers):
                break
            time.sleep(0.5)
        samples.append(sample(t0, pids, workers, stub, traffic))
        end_infos = worker_infos(workers)
        checks["pages_at_baseline"] = all(end_infos[n].get("free") == baseline[n] for n in workers)
        checks["settle_s"] = round(time.monotonic() - t0 - traffic_s, 1)
        if stack is not None:
            from tests.harness.stack import wait_redis_clean
            live, queues = wait_redis_clean(stack.redis, 60)
            checks["live_request_keys"] = live
            checks["queued"] = queues
            checks["dead_processes"] = {n: pr.returncode for n, pr in stack.procs.items() if pr.poll() is not None}
            from bench.fuzz import log_errors
            checks["log_errors"] = log_errors(stack.log_paths)
            checks["log_warnings"] = log_errors(stack.log_paths, levels=("WARNING",))
    finally:
        stop.set()
        channel.close()
        if stack is not None:
            stack.close()

    summary = {
        "traffic_s": round(traffic_s, 1), "requests_sent": traffic.sent, "requests_skipped_backlog": traffic.skipped,
        "outcomes": dict(sorted(traffic.outcomes.items())), "unexpected": len(traffic.unexpected),
        "output_tokens": traffic.tokens, "ttft_ms": pct(traffic.ttft), "e2e_ms": pct(traffic.e2e),
        "rss": summarize(samples, args.warmup_frac),
        "anon_rss": summarize(samples, args.warmup_frac, "anon"),
        "pages": {name: {"baseline": baseline[name], "end": end_infos[name].get("free"),
                         "total": end_infos[name].get("total")} for name in workers},
        "checks": checks,
    }
    write_json(args.out, {"benchmark": "soak", "config": {**vars(args), "address": address,
                                                          "model_info": str(model_info).replace("\n", " ")},
                          "summary": summary, "unexpected": traffic.unexpected[:50], "samples": samples})
    if args.png:
        plot(samples, args.png)
    print(json.dumps({k: v for k, v in summary.items() if k != "checks"}, indent=1))
    print("checks:", json.dumps(checks, indent=1))
    ok = checks.get("pages_at_baseline") and not traffic.unexpected and not checks.get("live_request_keys") \
        and not checks.get("dead_processes")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
