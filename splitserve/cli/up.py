"""``splitserve up``: Redis, a gateway, prefill and decode workers on this machine, supervised.

``plan`` turns ``up``'s flags into the processes to run (every flag reaches each child that
takes it); ``cmd_up`` boots them in order (Redis, the workers together, the gateway), waits
until the gateway is ready, and supervises them (``splitserve.cli.launcher.Supervisor``: a
child that dies is started again). A child that cannot boot the first time stops ``up`` (a
configuration error, not a crash). SIGTERM/SIGINT stop the gateway first, then the workers,
then Redis, each with its drain; while ``up`` is still starting them too, without waiting for
the boot to finish (the boot's waits look at the stop). ``--port 0`` and ``--http-port 0`` pick
the gateway's free ports here, so ``up`` knows and prints them.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from splitserve.cli.launcher import BOOT_TIMEOUT_S, CLI, STOP_TIMEOUT_S, ChildSpec, StoppedWhileStarting, Supervisor
from splitserve.cli.role_controller import LatencyWindow, RoleControl, RoleController, worker_role
from splitserve.common.processes import free_port
from splitserve.engine.openmp import BOUND_TEAM_SIZE


def memory_shares(total: float, prefill: int, decode: int, one_device: bool = True) -> dict[str, float]:
    """Each worker's ``--gpu-memory-utilization`` when ``up`` puts all of them on one GPU with ``total``.

    A decode worker's pool holds every running sequence's KV, a prefill worker's only the prompts
    in flight (and its prefix cache), so a decode worker gets twice a prefill worker's share: with
    one of each and 0.9, prefill 0.3 and decode 0.6. A colocated worker (both) gets all of it.
    ``one_device`` False (``--prefill-device`` and ``--decode-device`` differ): each role's workers
    split ``total`` of their own GPU."""
    if not 0 < total <= 1:
        raise SystemExit(f"--gpu-memory-utilization must be in (0, 1], got {total}")
    weights = prefill + 2 * decode
    if weights == 0:
        return {"both": total}
    if not one_device:
        return {"prefill": total / max(prefill, 1), "decode": total / max(decode, 1)}
    return {"prefill": total / weights, "decode": 2 * total / weights}


def role_device(args, role: str) -> str:
    """A worker's device: --prefill-device / --decode-device for its role when given, else
    --device (a colocated worker takes the decode side's)."""
    own = args.prefill_device if role == "prefill" else args.decode_device
    return own or args.device


def check_devices(args, role_controller: bool) -> None:
    """Workers on devices of their role: the role controller moves a worker to the other role in
    place, which would move it to another device; refused together."""
    if role_controller and role_device(args, "prefill") != role_device(args, "decode"):
        raise SystemExit("--role-controller moves workers between roles in place: it does not go with "
                         f"--prefill-device {role_device(args, 'prefill')} and --decode-device "
                         f"{role_device(args, 'decode')}")


# Below this many cores a CPU box gets one colocated worker when --prefill/--decode are not given.
# Split in two, each worker gets one core: the prefill worker's queue then holds first tokens for
# seconds (2-core AMD EPYC, SmolLM2 fp32, 2 req/s: TTFT p50 6.8x vLLM serve's disaggregated against
# 1.2x colocated, bench/results/compare_vllm_rate2.json), while colocated the engine's chunked
# prefill shares each step with the running decodes as vLLM's does.
MIN_CORES_TO_DISAGGREGATE = 4

# A decode worker's engine priority (nice value) where it shares the cores with prefill workers.
SHARED_DECODE_NICENESS = 19


@dataclass(frozen=True)
class Topology:
    prefill: int  # prefill workers (0 with decode 0: one colocated worker)
    decode: int  # decode workers
    why: str  # said at start-up


def topology(args, cores: int | None = None) -> Topology:
    """How many prefill and decode workers ``up`` starts: as given, else chosen from the device
    and the cores (``cores``: this machine's when None)."""
    if args.prefill is not None or args.decode is not None:
        prefill = 1 if args.prefill is None else args.prefill
        decode = 1 if args.decode is None else args.decode
        return Topology(prefill, decode, "as given (--prefill/--decode)")
    cores = cores if cores is not None else (os.cpu_count() or 1)
    if on_cpu(args) and cores < MIN_CORES_TO_DISAGGREGATE:
        return Topology(0, 0, f"one colocated worker: {cores} cores are too few to split between a prefill and "
                              f"a decode worker (each would get {max(1, cores // 2)}; first tokens then wait for "
                              f"the prefill worker). --prefill 1 --decode 1 splits them anyway")
    return Topology(1, 1, f"one prefill and one decode worker ({args.device}, {cores} cores)")


def on_cpu(args) -> bool:
    """Whether ``up``'s workers compute on the CPU: --device auto runs on CUDA where torch sees a
    GPU; without NVIDIA's device nodes it cannot (up itself does not load torch to ask)."""
    devices = {role_device(args, "prefill"), role_device(args, "decode")}
    return all(d.startswith("cpu") or (d == "auto" and not Path("/dev/nvidiactl").exists()) for d in devices)


def shares_cores(args, shape: Topology, cores: int | None = None) -> bool:
    """Whether prefill and decode workers share every core rather than split them: one worker of
    each on a CPU of 2 cores, one rank each, no thread counts given. Each
    worker then has a thread per core, and the decode worker's engine runs at the lowest priority
    (SHARED_DECODE_NICENESS): a prompt's prefill takes the cores when it comes, decoding has them
    between prompts -- what a colocated worker's steps do, across two processes. Each worker binds
    its threads one a core (splitserve/engine/openmp.py): unbound, both of one worker's threads
    sometimes shared a core and took turns for a whole prefill. Split in two, each worker had one
    core: a prompt's prefill took twice as long, and so did each decode step. Measured on 2 cores,
    ``vllm bench serve`` at 1 and 2 req/s: docs/performance.md."""
    cores = cores if cores is not None else (os.cpu_count() or 1)
    one_rank = tensor_parallel_size(args, "prefill") == 1 and tensor_parallel_size(args, "decode") == 1
    given = args.num_threads or args.prefill_threads or args.decode_threads
    # Two cores, where a worker's team of two is bound (BOUND_TEAM_SIZE); one worker of each kind:
    # two prefill workers would share the cores at one priority.
    return (on_cpu(args) and shape.prefill == shape.decode == 1 and cores == BOUND_TEAM_SIZE
            and one_rank and not given)


def startup_note(args, cores: int | None = None) -> str:
    """What ``up`` says at start: its workers and why, and how they share the cores."""
    shape = topology(args, cores)
    cores = cores if cores is not None else (os.cpu_count() or 1)
    if not shares_cores(args, shape, cores):
        return shape.why
    bound = "" if args.no_thread_binding else " bound one a core"
    return (f"{shape.why}; on {cores} cores the workers share them, each with {cores} threads{bound}, "
            f"prefill first (the decode worker's engine at nice {SHARED_DECODE_NICENESS}); "
            f"--prefill-threads/--decode-threads split them instead")


def with_internal_token(args):
    """``args`` with an ``--internal-token`` for the gateway's calls to the workers: the one given,
    else, when any security is on (a client or admin token, TLS), a fresh random one that only
    ``up``'s children learn (through their environment). Without security none is needed: the
    workers' ports are as open as the gateway's."""
    secured = args.auth_token or args.admin_token or args.token_file or args.tls_cert
    if args.internal_token or not secured:
        return args
    return argparse.Namespace(**{**vars(args), "internal_token": secrets.token_urlsafe(32)})


def with_redis_password(args):
    """``args`` with a ``--redis-password`` for the Redis ``up`` starts itself: the one given,
    else a fresh random one that only ``up``'s children learn (through their environment). A
    Redis without one is open to every local user, who could register a fake worker and be sent
    prompts and the internal token. A Redis given with ``--redis-url`` is the operator's."""
    if args.redis_url or args.redis_password:
        return args
    return argparse.Namespace(**{**vars(args), "redis_password": secrets.token_urlsafe(32)})


# Set per child: the Redis URL, the metrics port, the engine threads, the GPU memory share, the ranks.
OWN = frozenset({"redis_url", "metrics_port", "num_threads", "gpu_memory_utilization", "tensor_parallel_size",
                 "device", "engine_niceness"})


def tensor_parallel_size(args, role: str) -> int:
    """A worker's ranks: --prefill-tensor-parallel-size / --decode-tensor-parallel-size for its
    role when given, else --tensor-parallel-size (a colocated worker takes the decode side's)."""
    own = args.prefill_tensor_parallel_size if role == "prefill" else args.decode_tensor_parallel_size
    return own or args.tensor_parallel_size


def check_split(args) -> None:
    """Prefill and decode workers split over different numbers of ranks re-shard KV by head,
    which only shm and cuda_ipc can do: refuse, naming the flags, a transport list without them."""
    prefill, decode = tensor_parallel_size(args, "prefill"), tensor_parallel_size(args, "decode")
    if prefill == decode:
        return
    from splitserve.kvtransfer.head_map import RESHARD_TRANSPORTS
    named = RESHARD_TRANSPORTS if args.kv_transport == "auto" else [t.strip() for t in args.kv_transport.split(",")]
    if not set(named) & set(RESHARD_TRANSPORTS):
        raise SystemExit(f"--prefill-tensor-parallel-size {prefill} and --decode-tensor-parallel-size {decode} differ: "
                         f"KV is re-sharded by head over {', '.join(RESHARD_TRANSPORTS)} only, and --kv-transport "
                         f"is {args.kv_transport}")


class WorkerSpecs:
    """The command line of each of ``up``'s workers: ``plan``'s, and a moved worker's
    (``--role-controller``) in its new role, on the same cores and ports."""

    def __init__(self, args, redis_url: str, shape: Topology, workers: int):
        self.args, self.redis_url = args, redis_url
        # Every worker runs on the one --device, or its role's (--prefill-device, --decode-device;
        # rank r of a tensor-parallel worker on the r-th GPU after it): --gpu-memory-utilization is
        # split between the workers that share a GPU.
        one_device = role_device(args, "prefill") == role_device(args, "decode")
        self.shares = memory_shares(args.gpu_memory_utilization, shape.prefill, shape.decode, one_device) \
            if args.gpu_memory_utilization else {}
        # Worker processes split the cores: with more threads than cores, at one priority, they only
        # contend (measured: 1 thread each for prefill + decode on 2 cores halved TTFT at 2 req/s).
        # On a small CPU they share every core instead, the decode engine below (shares_cores).
        # A tensor-parallel worker's ranks are processes too, each with the worker's thread count.
        ranks = (shape.prefill * tensor_parallel_size(args, "prefill")
                 + shape.decode * tensor_parallel_size(args, "decode")) or tensor_parallel_size(args, "both")
        cores = os.cpu_count() or 1
        even = args.num_threads or max(1, cores // max(1, ranks))
        self.threads = {"prefill": args.prefill_threads or even, "decode": args.decode_threads or even,
                        "both": args.decode_threads or even}
        self.niceness = {"prefill": args.engine_niceness, "decode": args.engine_niceness, "both": args.engine_niceness}
        if shares_cores(args, shape, cores):
            self.threads.update(prefill=cores, decode=cores)
            self.niceness["decode"] = SHARED_DECODE_NICENESS
        self._slot_share: dict[int, float] = {}

    def spec(self, role: str, name: str, slot: int) -> ChildSpec:
        """Worker ``name`` of ``role`` in place ``slot`` (1, 2...: its metrics port after the gateway's)."""
        from splitserve.cli.flags import forward
        args = self.args
        flags, env = forward(args, "prefill" if role == "prefill" else "decode", skip=OWN)
        argv = ["decode", "--role", "both"] if role == "both" else [role]
        argv += [*flags, "--redis-url", self.redis_url, "--num-threads", str(self.threads[role]),
                 "--engine-niceness", str(self.niceness[role]),
                 "--tensor-parallel-size", str(tensor_parallel_size(args, role)), "--device", role_device(args, role)]
        if self.shares:
            # A moved worker keeps its place's share: the shares of the places add up to the flag's.
            share = self._slot_share.setdefault(slot, self.shares[role])
            argv += ["--gpu-memory-utilization", f"{share:.4f}"]
        if args.metrics_port > 0:  # the gateway on the port given, workers on the ports after it
            argv += ["--metrics-port", str(args.metrics_port + slot)]
        elif args.metrics_port == 0:
            argv += ["--metrics-port", "0"]
        return ChildSpec(name, [*CLI, "--log-level", args.child_log_level, *argv], "serving on", env, slot)


def plan(args, redis_url: str, workdir: str) -> list[ChildSpec]:
    """The processes of ``splitserve up <args>``: every flag reaches each child that takes it."""
    from splitserve.cli.flags import forward
    args = with_redis_password(with_internal_token(args))
    cli = [*CLI, "--log-level", args.child_log_level]
    specs: list[ChildSpec] = []
    if not args.redis_url:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server not found: install it (apt-get install redis-server) or pass --redis-url")
        port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
        # The password goes in a file only this user reads, not on a command line every user sees.
        config = Path(workdir) / "redis.conf"
        config.touch(mode=0o600)
        config.write_text(f"requirepass {args.redis_password}\n")
        argv = [binary, str(config), "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir, "--save", "",
                "--appendonly", "yes"]
        specs.append(ChildSpec("redis", argv, "Ready to accept connections"))
    shape = topology(args)
    roles = [("decode", i) for i in range(shape.decode)] + [("prefill", i) for i in range(shape.prefill)]
    if not roles:
        roles = [("both", None)]
    worker = WorkerSpecs(args, redis_url, shape, len(roles))
    for k, (role, i) in enumerate(roles, start=1):
        specs.append(worker.spec(role, role if i is None else f"{role}{i}", k))
    flags, env = forward(args, "gateway", skip=OWN)
    specs.append(ChildSpec("gateway", cli + ["gateway", *flags, "--redis-url", redis_url,
                                             "--metrics-port", str(args.metrics_port)], "serving on", env))
    return specs


def role_control(args) -> RoleControl:
    """``up``'s role controller settings; a fleet its minimums cannot hold is refused here."""
    control = RoleControl(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RoleControl)})
    if control.role_controller:
        shape = topology(args)
        try:
            control.check_fleet(shape.prefill, shape.decode, args.disaggregation)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    return control


def cmd_up(args) -> int:
    if args.gpu_memory_utilization and all(role_device(args, r).startswith("cpu") for r in ("prefill", "decode")):
        raise SystemExit("--gpu-memory-utilization shares a GPU; on CPU size the KV pools with --kv-cache-memory-gb")
    from splitserve.common.authz import gateway_credentials
    control = role_control(args)
    check_split(args)
    check_devices(args, control.role_controller)
    if control.role_controller and args.metrics_port <= 0:  # the controller reads the gateway's latencies
        args = argparse.Namespace(**{**vars(args), "metrics_port": free_port()})
    # Once: a worker the controller moves starts with the same secrets as the others.
    args = with_redis_password(with_internal_token(args))
    taken = {args.metrics_port} if args.metrics_port > 0 else set()
    for port in ("port", "http_port"):  # 0, "a free one": chosen here, where up waits on it and prints it
        if getattr(args, port) == 0:
            args = argparse.Namespace(**{**vars(args), port: free_port(avoid=taken)})
        taken.add(getattr(args, port))
    gateway_credentials(args)  # a bad security flag stops here, before anything starts
    print(f"splitserve up: {startup_note(args)}", flush=True)
    workdir = tempfile.mkdtemp(prefix="splitserve-up-")
    redis_url = args.redis_url or f"redis://127.0.0.1:{free_port(avoid=taken)}/0"
    supervisor = Supervisor(plan(args, redis_url, workdir))
    names = [c.spec.name for c in supervisor.children]
    workers = [n for n in names if n not in ("redis", "gateway")]
    stop = threading.Event()  # set by SIGTERM/SIGINT; the boot's waits look at it too
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if "redis" in names:
            supervisor.boot(["redis"], stop=stop)
        supervisor.boot(workers, stop=stop)
        supervisor.boot(["gateway"], stop=stop)
        address = f"{args.host}:{args.port}"
        _wait_serving(address, args, stop)
        http = f", OpenAI HTTP http://{args.host}:{args.http_port}/v1" if args.http_port > 0 else ""
        print(f"splitserve is up: gRPC {address}{http} (Redis {redis_url})", flush=True)
        if args.demo:
            return _demo(address, args.demo, args)
        controller = _controller(control, args, supervisor, redis_url, len(workers))
        supervisor.watch(stop, tick=controller.tick if controller else None)
        return 0
    except StoppedWhileStarting:
        print("splitserve up: stopped while starting", flush=True)
        return 0
    finally:
        workers = supervisor.names(exclude=("redis", "gateway"))  # as they are now (roles may have moved)
        supervisor.stop([["gateway"], workers, ["redis"] if "redis" in names else []])
        shutil.rmtree(workdir, ignore_errors=True)


def _controller(control: RoleControl, args, supervisor: Supervisor, redis_url: str, workers: int):
    if not control.role_controller:
        return None
    from splitserve.state.connect import make_client
    from splitserve.state.store import RedisState
    specs = WorkerSpecs(args, redis_url, topology(args), workers)
    for child in supervisor.children:  # the places' GPU memory shares, as plan gave them
        if child.spec.slot:
            specs.spec(worker_role(child.spec.name), child.spec.name, child.spec.slot)
    registry = RedisState(make_client(redis_url, password=args.redis_password or None))
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    print(f"splitserve up: role controller on: TTFT p90 target {control.role_ttft_target_ms:.0f} ms, TPOT p90 "
          f"target {control.role_tpot_target_ms:.0f} ms, at least {control.min_prefill_workers} prefill and "
          f"{control.min_decode_workers} decode workers", flush=True)
    return RoleController(control, supervisor, lambda role, name, old: specs.spec(role, name, old.slot),
                          LatencyWindow(f"{host}:{args.metrics_port}"), registry.workers, supervisor.say,
                          drain_s=args.drain_timeout_s + STOP_TIMEOUT_S)


def _wait_serving(address: str, args, stop: threading.Event) -> None:
    """Until the gateway's health says SERVING (it sees a usable set of workers in Redis);
    StoppedWhileStarting once ``stop`` is set."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitserve.common.security import Security
    with Security.from_args(args).channel(address.replace("0.0.0.0", "127.0.0.1")) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        give_up = time.monotonic() + BOOT_TIMEOUT_S
        while time.monotonic() < give_up:
            try:
                # Readiness: the gateway's own service, not liveness ("" is SERVING from its start).
                if stub.Check(health_pb2.HealthCheckRequest(service="splitserve.v1.Generation"), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if stop.wait(0.2):
                raise StoppedWhileStarting
    raise RuntimeError(f"the gateway did not report SERVING within {BOOT_TIMEOUT_S} s")


def _demo(address: str, question: str, args) -> int:
    """One chat request through the running stack, streamed to the terminal."""
    import grpc

    from splitserve.client import Client
    print(f"\nQ: {question}\nA: ", end="", flush=True)
    with Client(address, ca=args.tls_ca or None, cert=args.tls_cert or None, key=args.tls_key or None,
                token=args.auth_token or args.admin_token or None, max_message_mb=args.max_message_mb) as client:
        try:
            for event in client.generate(messages=[{"role": "user", "content": question}], max_tokens=64,
                                         temperature=0.0, timeout=300):
                if event.finished:
                    t = event.timeline
                    # A colocated worker prefills its own requests: the timeline names no prefill worker.
                    where = (f"prefill on {t.prefill_worker}, decode on {t.decode_worker}" if t.prefill_worker
                             else f"prefill and decode on {t.decode_worker}")
                    print(f"\n\n[{event.finish_reason}; {event.usage.completion_tokens} tokens; first token "
                          f"{t.first_token_ms:.0f} ms; {where}]", flush=True)
                else:
                    print(event.text, end="", flush=True)
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr, flush=True)
            return 1
    return 0
