"""Issue 36's before/after figures: a gateway of revision A and one of revision B, in turns, under
two hostile inputs.

    python -m bench.hostile_figures --a 6cfd8dd --b HEAD --rounds 3 --out bench/results/hostile_figures.json

Each round starts, for A then for B, a fresh stack from that revision's tree (a ``git worktree``):
Redis, one prefill and one decode worker (the tiny test model unless ``--model`` names another)
and a gateway with its HTTP API, then measures:

1. Gateway stall: one thread asks the gateway's grpc.health.v1 Check (service
   ``splitserve.v1.Generation``, 5 s timeout) every 20 ms while another sends ``--requests``
   Generate requests one at a time, each with a ``json_schema`` of ``--depth`` nested
   ``{"type": "array", "items": ...}`` levels ending in ``{"type": "integer"}`` (max_tokens 1,
   30 s timeout). Recorded: each request's status, details and latency; the health answers'
   latency during the requests (checks sent from the first request's start to half a second
   after the last one's answer, the same for both arms: B's refusals take milliseconds, shorter
   than one 20 ms poll) and in the second before them (idle). A warm-up request with a flat
   schema goes first, so the grammar library's import is not in the window.
2. HTTP body: POST /v1/completions with a JSON body of ``--body-mb`` MiB (a prompt of ``x``),
   once with Content-Length and once chunked; recorded: the status, the seconds from the first
   byte sent to the status line, and the gateway's peak resident memory above its resident
   memory before (``clear_refs`` 5, then ``VmHWM`` - ``VmRSS``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.common import write_json
from splitserve.common.processes import free_port
from splitserve.v1 import generation_pb2, generation_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
HEALTH_SERVICE = "splitserve.v1.Generation"
HEALTH_INTERVAL_S = 0.02
HEALTH_TIMEOUT_S = 5.0
TAIL_S = 0.5  # health is still polled this long after the last request's answer, in the window
REQUEST_TIMEOUT_S = 30.0
BOOT_TIMEOUT_S = 180.0
WORKER_ARGS = ["--dtype", "float32", "--block-size", "8", "--num-gpu-blocks", "256",
               "--max-num-batched-tokens", "128"]


def nested_schema(depth: int) -> str:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return json.dumps(schema)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
    return {"n": len(ordered), "p50": pick(0.5), "p99": pick(0.99), "max": ordered[-1]}


# ---- processes -------------------------------------------------------------------------------

class Proc:
    """``python -m splitserve.cli <args>`` from ``tree`` (its own code), logging to a file, until it
    prints ``serving on <address>``."""

    def __init__(self, tree: Path, args: list[str], log_path: Path):
        self.argv = [sys.executable, "-m", "splitserve.cli", "--log-level", "WARNING", *args]
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(self.argv, cwd=tree, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1",
                                          "TOKENIZERS_PARALLELISM": "false"})
        self.address = ""

    def wait_ready(self, timeout_s: float = BOOT_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = re.search(rb"serving on (\S+)", self.log_path.read_bytes())
            if m:
                self.address = m.group(1).decode()
                return self.address
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{shlex.join(self.argv)} did not start (code {self.proc.poll()}); its log ends: "
                           f"{self.log_path.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        try:
            from splitserve.common.locality import remove_pools_of
            remove_pools_of(self.proc.pid)  # a worker killed outright leaves its shm pool
        except ImportError:
            pass


class StackOf:
    """Redis, a prefill and a decode worker, and a gateway with its HTTP API, all of ``tree``."""

    def __init__(self, tree: Path, model: str, log_dir: Path, worker_args: list[str]):
        from tests.harness.redis_server import RedisServer
        self.procs: list[Proc] = []
        self.redis = RedisServer().start()
        try:
            for role in ("prefill", "decode"):
                self.procs.append(Proc(tree, [role, "--model", model, *worker_args, "--redis-url", self.redis.url],
                                       log_dir / f"{role}.log"))
            for p in self.procs:
                p.wait_ready()
            self.http_port = free_port()
            self.gateway = Proc(tree, ["gateway", "--model", model, "--host", "127.0.0.1", "--port", "0",
                                       "--http-port", str(self.http_port), "--redis-url", self.redis.url,
                                       "--block-size", "8"], log_dir / "gateway.log")
            self.procs.append(self.gateway)
            host_port = self.gateway.wait_ready()
            self.address = "127.0.0.1:" + host_port.rsplit(":", 1)[1]
            self.gateway_argv = self.gateway.argv
            self._wait_serving()
        except BaseException:
            self.close()
            raise

    def _wait_serving(self, timeout_s: float = 60.0) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(service=HEALTH_SERVICE), timeout=5).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"the gateway at {self.address} was not SERVING within {timeout_s:.0f} s")

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.redis.close()


# ---- 1. the gateway's stall under deep schemas ------------------------------------------------

class HealthPoller:
    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.stub = health_pb2_grpc.HealthStub(self.channel)
        self.samples: list[dict] = []  # {"t": sent (monotonic), "ms": latency, "status": name}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        request = health_pb2.HealthCheckRequest(service=HEALTH_SERVICE)
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(
                    self.stub.Check(request, timeout=HEALTH_TIMEOUT_S).status)
            except grpc.RpcError as e:
                status = e.code().name
            done = time.monotonic()
            self.samples.append({"t": sent, "ms": (done - sent) * 1e3, "status": status})
            self._stop.wait(max(0.0, HEALTH_INTERVAL_S - (done - sent)))

    def start(self) -> "HealthPoller":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(HEALTH_TIMEOUT_S + 1)
        self.channel.close()

    def window(self, start: float, end: float) -> dict:
        inside = [s for s in self.samples if start <= s["t"] <= end]
        out = percentiles([s["ms"] for s in inside])
        out["timed_out"] = sum(s["status"] == "DEADLINE_EXCEEDED" for s in inside)
        out["statuses"] = sorted({s["status"] for s in inside})
        return out


def generate(stub, request_id: str, schema: str) -> dict:
    sampling = generation_pb2.SamplingParams(max_tokens=1, temperature=0.0,
                                             structured_output=generation_pb2.StructuredOutput(json_schema=schema))
    request = generation_pb2.GenerateRequest(request_id=request_id, token_ids=[5, 6, 7], sampling=sampling)
    started = time.monotonic()
    code, details = "OK", ""
    try:
        for _ in stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
            pass
    except grpc.RpcError as e:
        code, details = e.code().name, e.details() or ""
    return {"code": code, "details": details[:300], "latency_s": time.monotonic() - started}


def measure_stall(address: str, requests: int, depth: int, tag: str) -> dict:
    schema = nested_schema(depth)
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        warmup = generate(stub, f"{tag}-warmup", json.dumps({"type": "integer"}))
        time.sleep(1.0)
        poller = HealthPoller(address).start()
        try:
            time.sleep(1.0)
            first = time.monotonic()
            results = [generate(stub, f"{tag}-{i}", schema) for i in range(requests)]
            last = time.monotonic()
            time.sleep(TAIL_S)
        finally:
            poller.stop()
    return {"schema_bytes": len(schema), "depth": depth, "warmup": warmup, "requests": results,
            "health_idle_ms": poller.window(first - 1.0, first - HEALTH_INTERVAL_S),
            "health_during_ms": poller.window(first, last + TAIL_S),
            "requests_window_s": last - first, "health_checks": len(poller.samples)}


# ---- 2. a large HTTP body ----------------------------------------------------------------------

def _rss_kib(pid: int, field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1))


def post_large(port: int, pid: int, body_mib: int, chunked: bool, model: str) -> dict:
    head = json.dumps({"model": model, "max_tokens": 1, "prompt": ""})[:-2].encode()  # ... "prompt": "
    body = bytearray(head)
    body += b"x" * ((body_mib << 20) - len(head) - 2)
    body += b'"}'
    view = memoryview(body)
    if chunked:
        framing = b"Transfer-Encoding: chunked\r\n"
    else:
        framing = f"Content-Length: {len(body)}\r\n".encode()
    headers = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + framing +
               b"Connection: close\r\n\r\n")
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    rss_before = _rss_kib(pid, "VmRSS")
    sock = socket.create_connection(("127.0.0.1", port))
    sent = [0]
    stop = threading.Event()

    def send() -> None:
        try:
            sock.sendall(headers)
            step = 1 << 20
            for offset in range(0, len(view), step):
                if stop.is_set():
                    return
                piece = view[offset:offset + step]
                if chunked:
                    sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
                else:
                    sock.sendall(piece)
                sent[0] = offset + len(piece)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass

    started = time.monotonic()
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    answer = b""
    deadline = started + 300
    try:
        while b"\r\n" not in answer and time.monotonic() < deadline:
            ready, _, _ = select.select([sock], [], [], 0.5)
            if ready:
                data = sock.recv(65536)
                if not data:
                    break
                answer += data
    except OSError as e:
        answer = answer or f"error {e}".encode()
    seconds = time.monotonic() - started
    stop.set()
    # The rest of the answer (its body says why), briefly.
    try:
        sock.settimeout(2)
        while len(answer) < 4096:
            data = sock.recv(4096)
            if not data:
                break
            answer += data
    except OSError:
        pass
    sock.close()
    sender.join(30)
    time.sleep(0.5)
    peak = _rss_kib(pid, "VmHWM")
    status_line = answer.split(b"\r\n", 1)[0].decode(errors="replace")
    m = re.match(r"HTTP/1\.\d (\d+)", status_line)
    return {"chunked": chunked, "body_bytes": len(body), "status": int(m.group(1)) if m else None,
            "status_line": status_line, "answer_body": answer.split(b"\r\n\r\n", 1)[-1][:300].decode(errors="replace"),
            "seconds_to_answer": seconds, "bytes_sent_by_then": sent[0],
            "rss_before_mib": rss_before / 1024, "peak_rss_growth_mib": (peak - rss_before) / 1024}


# ---- the run -----------------------------------------------------------------------------------

def run_arm(tree: Path, args, tag: str, log_dir: Path) -> dict:
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = StackOf(tree, args.model, log_dir, args.worker_args)
    try:
        stall = measure_stall(stack.address, args.requests, args.depth, tag)
        bodies = [post_large(stack.http_port, stack.gateway.proc.pid, args.body_mb, chunked, args.model_name)
                  for chunked in (False, True)]
        return {"gateway_argv": stack.gateway_argv[1:], "stall": stall, "http_body": bodies}
    finally:
        stack.close()


def _median(values) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def summarize(rounds: list[dict]) -> dict:
    latencies = [r["latency_s"] for rnd in rounds for r in rnd["stall"]["requests"]]
    codes: dict[str, int] = {}
    for rnd in rounds:
        for r in rnd["stall"]["requests"]:
            codes[r["code"]] = codes.get(r["code"], 0) + 1
    during = [rnd["stall"]["health_during_ms"] for rnd in rounds]
    out = {"request_codes": codes, "request_latency_s_median": statistics.median(latencies),
           "request_latency_s_max": max(latencies),
           "health_during_p50_ms_median": _median(d["p50"] for d in during if d["n"]),
           "health_during_p99_ms_median": _median(d["p99"] for d in during if d["n"]),
           "health_during_max_ms": max((d["max"] for d in during if d["n"]), default=None),
           "health_timed_out": sum(d["timed_out"] for d in during),
           "health_idle_p99_ms_median": _median(rnd["stall"]["health_idle_ms"]["p99"] for rnd in rounds
                                                if rnd["stall"]["health_idle_ms"]["n"])}
    for chunked in (False, True):
        name = "chunked" if chunked else "content_length"
        posts = [b for rnd in rounds for b in rnd["http_body"] if b["chunked"] == chunked]
        out[f"http_{name}"] = {"status": sorted({str(p["status"]) for p in posts}),
                               "seconds_median": statistics.median(p["seconds_to_answer"] for p in posts),
                               "peak_rss_growth_mib_median": statistics.median(p["peak_rss_growth_mib"] for p in posts),
                               "peak_rss_growth_mib_max": max(p["peak_rss_growth_mib"] for p in posts)}
    return out


def resolve(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", default="6cfd8dd", help="revision A (before)")
    parser.add_argument("--b", default="HEAD", help="revision B (after); '.' is this working tree as it is")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=5, help="deep-schema Generate requests per arm and round")
    parser.add_argument("--depth", type=int, default=300)
    parser.add_argument("--body-mb", type=int, default=256, help="MiB of the large HTTP body")
    parser.add_argument("--model", default=None, help="model of the stacks (default: a tiny test model, built here)")
    parser.add_argument("--quick", action="store_true", help="1 round, 2 requests, a 32 MiB body, eager workers")
    parser.add_argument("--only", choices=("A", "B"), help="run one arm (a check of the script, not a figure)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.body_mb = 1, 2, 32
    # Quick: the workers run op by op (they serve the warm-up and nothing the figures measure), so a
    # check of the script does not wait for two compiles.
    args.worker_args = WORKER_ARGS + (["--enforce-eager"] if args.quick else [])
    work = Path(tempfile.mkdtemp(prefix="hostile-figures-"))
    if args.model is None:
        from tests.harness.tiny_models import make_tiny_model
        args.model = str(make_tiny_model(work / "tiny-llama"))
    args.model_name = Path(args.model).name
    wanted = {arm: rev for arm, rev in (("A", args.a), ("B", args.b)) if args.only in (None, arm)}
    revisions = {arm: resolve("HEAD") + " (working tree)" if rev == "." else resolve(rev) for arm, rev in wanted.items()}
    trees, made = {}, []
    try:
        for arm, rev in wanted.items():
            if rev == ".":  # as it is: no worktree, and the kernels this tree already built
                trees[arm] = ROOT
                continue
            trees[arm] = work / f"rev-{arm.lower()}"
            subprocess.run(["git", "worktree", "add", "--detach", "-q", str(trees[arm]), revisions[arm]], cwd=ROOT,
                           check=True)
            made.append(trees[arm])
        runs: dict[str, list[dict]] = {arm: [] for arm in revisions}
        for i in range(args.rounds):
            for arm in revisions:
                result = run_arm(trees[arm], args, f"{arm.lower()}{i}", work / "logs" / f"{arm}{i}")
                runs[arm].append(result)
                s = result["stall"]
                print(arm, i, [(r["code"], round(r["latency_s"], 3)) for r in s["requests"]],
                      "health during", s["health_during_ms"],
                      [(b["status"], round(b["seconds_to_answer"], 2), round(b["peak_rss_growth_mib"], 1))
                       for b in result["http_body"]], flush=True)
    finally:
        for tree in made:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
        shutil.rmtree(work, ignore_errors=True)
    summary = {arm: summarize(rs) for arm, rs in runs.items()}
    write_json(args.out, {
        "benchmark": "hostile_figures", "issue": 36, "revisions": revisions, "model": args.model_name,
        "rounds": args.rounds, "requests": args.requests, "depth": args.depth, "body_mib": args.body_mb,
        "order": "A, B alternated each round, a fresh stack per arm and round",
        "command": "python -m bench.hostile_figures " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "worker_args": args.worker_args, "health": {"service": HEALTH_SERVICE, "interval_s": HEALTH_INTERVAL_S,
                                               "timeout_s": HEALTH_TIMEOUT_S},
        "method": re.sub(r"\s+", " ", __doc__.split("\n\n", 2)[2]), "runs": runs, "summary": summary})
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
