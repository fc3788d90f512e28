"""``splitserve up``: Redis, a gateway, prefill and decode workers, all on this machine.

Children get PR_SET_PDEATHSIG, so even a ``kill -9`` of ``up`` leaves no orphan behind; a
child that dies takes the whole stack down (a half-running stack would only mislead).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

BOOT_TIMEOUT_S = 300


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the thread that spawned it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent,
                            env={**os.environ, **env} if env else None)


def _wait_line(proc: subprocess.Popen, marker: str, what: str) -> str:
    result: list[str] = []

    def read():
        for line in proc.stdout:
            if marker in line:
                result.append(line.strip())
                return
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(BOOT_TIMEOUT_S)
    if not result:
        raise RuntimeError(f"{what} did not start within {BOOT_TIMEOUT_S} s (exit code {proc.poll()})")
    return result[0]


def start_redis(directory: str) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: install it (apt-get install redis-server) or pass --redis-url")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", directory,
                             "--save", "", "--appendonly", "yes"],
                            stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    _wait_line(proc, "Ready to accept connections", "redis-server")
    return proc, f"redis://127.0.0.1:{port}/0"


def memory_shares(total: float, prefill: int, decode: int) -> dict[str, float]:
    """Each worker's ``--gpu-memory-utilization`` when ``up`` puts all of them on one GPU with ``total``.

    A decode worker's pool holds every running sequence's KV, a prefill worker's only the prompts
    in flight (and its prefix cache), so a decode worker gets twice a prefill worker's share: with
    one of each and 0.9, prefill 0.3 and decode 0.6. A colocated worker (both) gets all of it."""
    if not 0 < total <= 1:
        raise SystemExit(f"--gpu-memory-utilization must be in (0, 1], got {total}")
    weights = prefill + 2 * decode
    if weights == 0:
        return {"both": total}
    return {"prefill": total / weights, "decode": 2 * total / weights}


def cmd_up(args) -> int:
    if args.gpu_memory_utilization and args.device.startswith("cpu"):
        raise SystemExit("--gpu-memory-utilization shares a GPU; on CPU size the KV pools with --kv-cache-memory-gb")
    workdir = tempfile.mkdtemp(prefix="splitserve-up-")
    procs: list[subprocess.Popen] = []
    cli = [sys.executable, "-m", "splitserve.cli", "--log-level", args.child_log_level]
    from splitserve.security import Security, security_argv
    Security.from_args(args)  # a bad --tls-* flag stops here, before anything starts
    # TLS/token flags go to every child; secrets (token, Redis password) through the environment.
    secure, child_env = security_argv(args)
    if args.no_reflection:
        secure.append("--no-reflection")
    if args.redis_url and args.redis_password:
        child_env["SPLITSERVE_REDIS_PASSWORD"] = args.redis_password
    try:
        redis_url = args.redis_url
        if not redis_url:
            proc, redis_url = start_redis(workdir)
            procs.append(proc)
        engine = ["--model", args.model, "--dtype", args.dtype, "--device", args.device,
                  "--block-size", str(args.block_size), "--kv-cache-memory-gb", str(args.kv_cache_memory_gb),
                  "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
                  str(args.max_num_batched_tokens), "--redis-url", redis_url, *secure,
                  "--scheduling-policy", args.scheduling_policy, "--batching", args.batching,
                  "--static-batch-size", str(args.static_batch_size)]
        if args.num_gpu_blocks:
            engine += ["--num-gpu-blocks", str(args.num_gpu_blocks)]
        num_workers = max(1, args.decode + args.prefill)
        # Worker processes share the cores: with more threads than cores they only contend
        # (measured: 1 thread each for prefill + decode on 2 cores halved TTFT at 2 req/s).
        threads = args.num_threads or max(1, (os.cpu_count() or 1) // num_workers)
        engine += ["--num-threads", str(threads)]
        workers = [["decode", *engine] for _ in range(args.decode)]
        workers += [["prefill", *engine] for _ in range(args.prefill)]
        if args.decode == 0 and args.prefill == 0:
            workers = [["decode", "--role", "both", *engine]]
        if args.metrics_port > 0:  # the gateway on the port given, workers on the ports after it
            for i, argv in enumerate(workers, start=1):
                argv += ["--metrics-port", str(args.metrics_port + i)]
        elif args.metrics_port == 0:
            for argv in workers:
                argv += ["--metrics-port", "0"]
        if args.gpu_memory_utilization:  # every worker on the one --device: split its share between them
            shares = memory_shares(args.gpu_memory_utilization, args.prefill, args.decode)
            for argv in workers:
                role = "both" if "both" in argv else argv[0]
                argv += ["--gpu-memory-utilization", f"{shares[role]:.4f}"]
        for argv in workers:
            procs.append(_spawn(cli + argv, child_env))
        for proc, argv in zip(procs[-len(workers):], workers):
            print(_wait_line(proc, "serving on", argv[0]), flush=True)
        gateway = _spawn(cli + ["gateway", "--model", args.model, "--host", args.host, "--port", str(args.port),
                                "--redis-url", redis_url, "--block-size", str(args.block_size),
                                "--metrics-port", str(args.metrics_port), *secure], child_env)
        procs.append(gateway)
        print(_wait_line(gateway, "serving on", "gateway"), flush=True)
        _wait_serving(f"{args.host}:{args.port}", args)
        print(f"splitserve is up: gRPC {args.host}:{args.port} (Redis {redis_url})", flush=True)
        if args.demo:
            return _demo(f"{args.host}:{args.port}", args.demo, args)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(0.5):
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                print(f"a process of the stack exited ({dead[0].args[3:5]}, code {dead[0].returncode}); "
                      "stopping the rest", file=sys.stderr, flush=True)
                return 1
        return 0
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 15
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_serving(address: str, args) -> None:
    """Until the gateway's health says SERVING (it sees a usable set of workers in Redis)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitserve.security import Security
    import grpc
    with Security.from_args(args).channel(address.replace("0.0.0.0", "127.0.0.1")) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        give_up = time.monotonic() + BOOT_TIMEOUT_S
        while time.monotonic() < give_up:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"the gateway did not report SERVING within {BOOT_TIMEOUT_S} s")


def _demo(address: str, question: str, args) -> int:
    """One chat request through the running stack, streamed to the terminal."""
    from splitserve.client import Client
    print(f"\nQ: {question}\nA: ", end="", flush=True)
    with Client(address, ca=args.tls_ca or None, cert=args.tls_cert or None, key=args.tls_key or None,
                token=args.auth_token or None, max_message_mb=args.max_message_mb) as client:
        for event in client.generate(messages=[{"role": "user", "content": question}], max_tokens=64,
                                     temperature=0.0, timeout=300):
            if event.finished:
                t = event.timeline
                print(f"\n\n[{event.finish_reason}; {event.usage.completion_tokens} tokens; first token "
                      f"{t.first_token_ms:.0f} ms; prefill on {t.prefill_worker}, decode on {t.decode_worker}]",
                      flush=True)
            else:
                print(event.text, end="", flush=True)
    return 0


def add_up_parser(sub, engine_flags) -> None:
    up = sub.add_parser("up", help="start Redis, a gateway, prefill and decode workers on this machine")
    engine_flags(up)
    up.set_defaults(host="127.0.0.1", port=int(os.environ.get("SPLITSERVE_PORT", 50051)))
    up.add_argument("--prefill", type=int, default=1, help="prefill workers (0 with --decode 0: one 'both' worker)")
    up.add_argument("--decode", type=int, default=1, help="decode workers")
    up.add_argument("--demo", metavar="QUESTION", default="",
                    help="ask one question through the stack, print the answer, then shut down")
    up.add_argument("--child-log-level", default="WARNING", help="log level of the processes it starts")
    up.set_defaults(func=cmd_up)
