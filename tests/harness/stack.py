"""A whole splitserve stack as real processes on loopback, for tests and benchmarks.

    stack = start_stack(model_dir, tmp_path, prefill=1, decode=2)
    try:
        baseline = stack.free_pages()                 # {"prefill": 256, "decode0": 256, "decode1": 256}
        for event in stack.client.generate([1, 2, 3], max_tokens=4, temperature=0.0):
            ...
        stack.kill("decode1")                         # SIGKILL one worker (fault injection)
        wait_pages_at_baseline(stack, baseline, names=["prefill", "decode0"])
        stack.restart("decode1")                      # same arguments, new port, registered again
        assert live_request_keys(stack.redis) == []
    finally:
        stack.close()

Process names: ``"gateway"``; workers are named after their role (``"prefill"``, ``"decode"``,
``"both"``) when there is one of that role, and ``"<role><i>"`` (``"decode0"``, ``"decode1"``...)
when there are several. ``stack.names(role)`` lists them in order. Each process writes INFO
logs as JSON lines to ``stack.log_paths[name]`` (``<log_dir>/<name>.log``); Redis logs to
``stack.redis.log_path``.

Several hosts: ``wrap`` runs each named process under an argv prefix (a network namespace of
``tests.harness.netns``), ``name_args`` gives it its own flags (``--host``/``--advertise-host``),
``redis_server`` is a ``RedisServer`` bound where it should be, and ``internal_token`` is every
process's ``--internal-token`` (the stack's own worker stubs send it too).

``kill(name, sig)`` also freezes (SIGSTOP) and thaws (SIGCONT) a process; ``role_args`` gives
one role different flags (``{"decode": ["--lease-ttl-s", "5"]}``), ``role_env`` different
environment variables (``{"prefill": {"SPLITSERVE_FAULT_STEP_DELAY_S": "0.5"}}``).

Every wait is bounded (boot, registration, page checks, shutdown), children die with the
thread that started them (Linux parent-death signal), and ``close()`` stops everything it
started, Redis included. Start a stack from a thread that outlives it (pytest fixtures run on
the main thread).
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2

from splitserve.cli.launcher import CLI, Process, spawn
from splitserve.client import Client
from splitserve.common.locality import remove_pools_of
from splitserve.common.processes import free_port
from splitserve.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.harness.redis_server import RedisServer

__all__ = ["Stack", "start_stack", "start_process", "worker_info", "kv_free_blocks", "wait_free_pages",
           "wait_pages_at_baseline",
           "live_request_keys", "queued_request_ids", "wait_redis_clean", "health", "gateway_health", "SERVING",
           "NOT_SERVING", "DEFAULT_WORKER_ARGS", "BOOT_TIMEOUT_S"]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Seconds a process may take from spawn to its "serving on" line (torch import + model load
# on a busy 2-core box).
BOOT_TIMEOUT_S = 180.0
# Seconds the gateway may take to see every worker in the Redis registry.
REGISTER_TIMEOUT_S = 60.0
# Engine flags every worker gets unless ``worker_args`` overrides them (argparse: the last wins).
DEFAULT_WORKER_ARGS = ("--dtype", "float32", "--block-size", "8", "--num-gpu-blocks", "256",
                       "--max-num-batched-tokens", "128")
_ROLES = ("prefill", "decode", "both")
_REPO_ROOT = Path(__file__).resolve().parents[2]


def _spawn(args: Sequence[str], log_path: Path | None, env: dict[str, str] | None = None,
           prefix: Sequence[str] = ()) -> Process:
    """``<prefix> python -m splitserve.cli <args>`` through the launcher, from the calling thread
    (SIGKILL when it ends: a frozen child must die too), with ``env`` on top of this process's
    environment; it is ready once it prints ``serving on``."""
    logging = ["--log-level", "INFO", "--log-format", "json"] if log_path else ["--log-level", "WARNING"]
    return spawn([*prefix, *CLI, *logging, *args], "serving on", log_path=log_path, cwd=_REPO_ROOT,
                 env={"PYTHONPATH": str(_REPO_ROOT), **(env or {})}, death_signal=signal.SIGKILL)


def _started(process: Process, timeout_s: float = BOOT_TIMEOUT_S) -> tuple[subprocess.Popen, str]:
    """The process and the address of its ``serving on <host:port>`` line."""
    return process.proc, process.wait_ready(timeout_s).rsplit(" ", 1)[-1]


def start_process(args: Sequence[str], log_path: Path | None = None, timeout_s: float = BOOT_TIMEOUT_S,
                  env: dict[str, str] | None = None, prefix: Sequence[str] = ()) -> tuple[subprocess.Popen, str]:
    """``python -m splitserve.cli <args>`` until it prints ``serving on <host:port>``.

    With ``log_path``, INFO logs go there as JSON lines (appended), and so does anything else
    the process prints on stdout; ``env`` is added to this process's environment. Returns the
    process and the address it serves on; raises ``RuntimeError`` (after killing it) if it exits
    or stays silent for ``timeout_s``. ``prefix``: an argv prefix that execs the command (e.g.
    ``ip netns exec <ns>``).
    """
    return _started(_spawn(args, log_path, env, prefix), timeout_s)


def stop_process(proc: subprocess.Popen, log_path: Path | None = None, timeout_s: float = 30.0) -> int:
    """SIGTERM ``proc`` and wait for it to exit; one still there after ``timeout_s`` is killed and
    fails the caller with the tail of its log (where a gateway says which step held its exit)."""
    proc.terminate()
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        tail = log_path.read_text(errors="replace")[-4000:] if log_path else ""
        raise AssertionError(f"{shlex.join(map(str, proc.args))} did not exit within {timeout_s:g} s of SIGTERM; its log ends: {tail}")


@dataclass(repr=False)
class Stack:
    """A running stack. Fields are plain data; the methods are the only helpers tests need."""

    model: str                             # model directory or alias the processes serve
    redis: RedisServer                     # the private Redis (``.client()``, ``.url``, ``.kill()``...)
    gateway_address: str                   # host:port of the public Generation service
    client: Client                         # a splitserve.client.Client on the gateway
    procs: dict[str, subprocess.Popen]     # name -> process (gateway and workers, not Redis)
    addresses: dict[str, str]              # worker name -> its worker gRPC address
    roles: dict[str, str]                  # worker name -> prefill | decode | both
    log_dir: Path
    log_paths: dict[str, Path]             # name -> JSON-lines log file
    metrics_ports: dict[str, int] = field(default_factory=dict)  # name -> Prometheus port (if enabled)
    http: str = ""                         # base URL of the gateway's OpenAI HTTP API (if enabled)
    argv: dict[str, list[str]] = field(default_factory=dict)     # name -> CLI arguments it was started with
    env: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> environment it got on top of ours
    wrap: dict[str, list[str]] = field(default_factory=dict)     # name -> argv prefix it runs under (if any)
    metrics_addresses: dict[str, str] = field(default_factory=dict)  # name -> host:port of its /metrics
    internal_token: str = ""               # every process's --internal-token ("" when none)
    _channels: dict[str, grpc.Channel] = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        return f"Stack(gateway={self.gateway_address}, workers={self.addresses}, redis={self.redis.url})"

    def _repr_pretty_(self, p, cycle) -> None:  # hypothesis/IPython print this, not every field
        p.text(repr(self))

    # ---- looking things up

    def names(self, role: str) -> list[str]:
        """Worker names of ``role`` (prefill, decode, both), in start order."""
        return [name for name, r in self.roles.items() if r == role]

    @property
    def stub(self) -> generation_pb2_grpc.GenerationStub:
        """A raw stub of the public service (shares the client's channel)."""
        return self.client.stub

    def worker_stub(self, name: str):
        """DecodeWorkerStub (decode/both) or PrefillWorkerStub (prefill) of worker ``name``."""
        channel = self._channels.get(name)
        if channel is None:
            if self.internal_token:
                from splitserve.common.security import Security
                channel = Security(token=self.internal_token).channel(self.addresses[name])
            else:
                channel = grpc.insecure_channel(self.addresses[name])
            self._channels[name] = channel
        if self.roles[name] == "prefill":
            return worker_pb2_grpc.PrefillWorkerStub(channel)
        return worker_pb2_grpc.DecodeWorkerStub(channel)

    def free_pages(self, names: Iterable[str] | None = None) -> dict[str, int]:
        """Free KV pages (prefix-cached ones count as free) of each worker, by name."""
        return {name: worker_info(self.worker_stub(name)).kv_blocks_free
                for name in (self.roles if names is None else names)}

    # ---- fault injection

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout_s: float = 20.0) -> int | None:
        """Send ``sig`` to process ``name``. A terminating signal waits (bounded) for the exit and
        returns the exit code; SIGSTOP/SIGCONT (freeze/thaw a process) return None at once."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
        if sig in (signal.SIGSTOP, signal.SIGCONT):
            return None
        code = proc.wait(timeout_s)
        remove_pools_of(proc.pid)  # as `splitserve up`'s supervisor does for a worker that died
        return code

    def restart(self, name: str) -> str:
        """Start process ``name`` again with its original arguments (after ``kill``); a worker
        gets a new port, and this returns once the gateway lists it. Returns its new address."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running: kill it first")
        self._channels.pop(name, None)
        proc, address = start_process(self.argv[name], self.log_paths[name], env=self.env.get(name),
                                      prefix=self.wrap.get(name, ()))
        self.procs[name] = proc
        if name in self.roles:
            self.addresses[name] = address
            info = _wait_listed(self, {address})
            for w in info.workers:
                if w.address == address and w.metrics_address:
                    self.metrics_ports[name] = int(w.metrics_address.rsplit(":", 1)[1])
                    self.metrics_addresses[name] = w.metrics_address
        else:
            self.gateway_address = address
            self.client.close()
            self.client = Client(address)
        return address

    # ---- shutdown

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every process (gateway first), SIGKILL what is left after ``timeout_s``, stop Redis."""
        try:
            self.client.close()
        except Exception:
            pass
        for channel in self._channels.values():
            channel.close()
        order = ["gateway", *[n for n in self.procs if n != "gateway"]]
        for name in order:
            if name in self.procs and self.procs[name].poll() is None:
                self.procs[name].terminate()
                self.procs[name].send_signal(signal.SIGCONT)  # a frozen process must see the SIGTERM
        deadline = time.monotonic() + timeout_s
        for name in order:
            proc = self.procs.get(name)
            if proc is None:
                continue
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
                remove_pools_of(proc.pid)  # one that stopped in time removed its own
        self.redis.close()


def _worker_names(prefill: int, decode: int, both: int) -> list[tuple[str, str]]:
    out = []
    for role, count in zip(_ROLES, (prefill, decode, both)):
        out += [(role if count == 1 else f"{role}{i}", role) for i in range(count)]
    return out


def start_stack(model: str | os.PathLike, log_dir: str | os.PathLike | None = None, *, prefill: int = 1,
                decode: int = 1, both: int = 0, worker_args: Sequence[str] = (),
                role_args: dict[str, Sequence[str]] | None = None,
                role_env: dict[str, dict[str, str]] | None = None, gateway_args: Sequence[str] = (),
                gateway_env: dict[str, str] | None = None,
                redis_kwargs: dict | None = None, metrics: bool = True, http: bool = False,
                worker_defaults: Sequence[str] = DEFAULT_WORKER_ARGS, wrap: dict[str, Sequence[str]] | None = None,
                name_args: dict[str, Sequence[str]] | None = None, gateway_host: str = "127.0.0.1",
                redis_server: RedisServer | None = None, internal_token: str = "") -> Stack:
    """Redis, ``decode`` decode workers, ``prefill`` prefill workers, ``both`` colocated workers
    (booted in parallel), then a gateway; returns once the gateway lists every worker.

    ``log_dir``: a directory, or a pytest ``tmp_path_factory`` (a fresh ``logs`` dir is made);
    None makes a temporary one. ``worker_args`` are appended to every worker's command line
    after ``worker_defaults`` (so they override it), then ``role_args[role]`` to the workers of
    that role (e.g. ``{"decode": ["--lease-ttl-s", "300"]}``), ``gateway_args`` to the gateway's.
    ``role_env[role]`` is added to the environment of the processes of that role (``"gateway"``
    too, as is ``gateway_env``; fault injection:
    ``{"prefill": {"SPLITSERVE_FAULT_STEP_DELAY_S": "0.5"}}``).
    ``redis_kwargs`` go to ``RedisServer`` (default: append-only, in ``<log_dir>/redis``).
    ``metrics``: every process serves Prometheus metrics on a free port (``metrics_ports``);
    ``http``: the gateway serves its OpenAI HTTP API on a free port (``stack.http``).
    Several hosts: ``wrap[name]`` is an argv prefix process ``name`` runs under, ``name_args[name]``
    its own flags (appended last), ``gateway_host`` the address the gateway listens on and is
    dialled at, ``redis_server`` an unstarted ``RedisServer`` to use (started and closed here),
    ``internal_token`` every process's ``SPLITSERVE_INTERNAL_TOKEN``.
    On any failure, whatever was started is stopped before the error propagates.
    """
    if hasattr(log_dir, "mktemp"):
        log_dir = log_dir.mktemp("stack")
    elif log_dir is None:
        import tempfile
        log_dir = tempfile.mkdtemp(prefix="ss-stack-")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    model = str(model)
    kwargs = {"appendonly": True, "dir": log_dir / "redis"} if redis_kwargs is None else dict(redis_kwargs)
    if kwargs.get("dir") is not None:
        Path(kwargs["dir"]).mkdir(parents=True, exist_ok=True)
    redis_server = (redis_server or RedisServer(**kwargs)).start()
    wrap, name_args = {k: list(v) for k, v in (wrap or {}).items()}, name_args or {}
    token_env = {"SPLITSERVE_INTERNAL_TOKEN": internal_token} if internal_token else {}
    stack = Stack(model=model, redis=redis_server, gateway_address="", client=None, procs={}, addresses={},
                  roles={}, log_dir=log_dir, log_paths={}, wrap=wrap, internal_token=internal_token)
    metrics_flag = ["--metrics-port", "0"] if metrics else []
    try:
        workers = _worker_names(prefill, decode, both)
        if not any(role in ("decode", "both") for _, role in workers):
            raise ValueError("a stack needs a decode or a both worker")
        # Spawn every worker and the gateway at once (they boot in parallel: the gateway finds
        # the workers in Redis whenever they register), then wait for each.
        pending = []
        for name, role in workers:
            cli_role = ["decode", "--role", "both"] if role == "both" else [role]
            argv = [*cli_role, "--model", model, *worker_defaults, "--redis-url", redis_server.url,
                    "--worker-id", f"{name}-{os.getpid()}", *metrics_flag, *worker_args,
                    *(role_args or {}).get(role, ()), *name_args.get(name, ())]
            stack.argv[name], stack.roles[name] = argv, role
            stack.env[name] = {**token_env, **(role_env or {}).get(role, {})}
            stack.log_paths[name] = log_dir / f"{name}.log"
            pending.append((name, _spawn(argv, stack.log_paths[name], stack.env[name], wrap.get(name, ()))))
        argv = ["gateway", "--model", model, "--host", gateway_host, "--port", "0", "--redis-url", redis_server.url,
                "--block-size", _flag_value([*worker_defaults, *worker_args], "--block-size", "16"),
                *metrics_flag, *gateway_args, *name_args.get("gateway", ())]
        if http:
            port = free_port()
            argv += ["--http-port", str(port)]
            stack.http = f"http://{gateway_host}:{port}"
        stack.argv["gateway"], stack.log_paths["gateway"] = argv, log_dir / "gateway.log"
        stack.env["gateway"] = {**token_env, **(role_env or {}).get("gateway", {}), **(gateway_env or {})}
        gateway = _spawn(argv, stack.log_paths["gateway"], stack.env["gateway"], wrap.get("gateway", ()))
        stack.procs["gateway"] = gateway.proc
        for name, boot in pending:
            stack.procs[name] = boot.proc  # known to close() even if it never boots
        for name, boot in pending:
            stack.procs[name], stack.addresses[name] = _started(boot)
        stack.procs["gateway"], stack.gateway_address = _started(gateway)
        stack.client = Client(stack.gateway_address)
        _wait_registered(stack, metrics)
        return stack
    except BaseException:
        if stack.client is None:
            stack.client = Client("127.0.0.1:1")  # close() closes it
        stack.close()
        raise


def _flag_value(argv: Sequence[str], flag: str, default: str) -> str:
    """The value of the last ``flag`` in ``argv`` (argparse semantics), else ``default``."""
    value = default
    for i, arg in enumerate(argv[:-1]):
        if arg == flag:
            value = argv[i + 1]
    return value


def _wait_listed(stack: Stack, wanted: set[str]) -> generation_pb2.ServerInfo:
    """Until GetServerInfo lists every worker address in ``wanted`` (bounded)."""
    deadline = time.monotonic() + REGISTER_TIMEOUT_S
    info = None
    while time.monotonic() < deadline:
        try:
            info = stack.client.stub.GetServerInfo(generation_pb2.GetServerInfoRequest(), timeout=5)
        except grpc.RpcError:
            info = None
        if info is not None and wanted <= {w.address for w in info.workers if w.role != "gateway"}:
            return info
        time.sleep(0.2)
    seen = sorted(w.address for w in info.workers) if info is not None else "no answer"
    raise RuntimeError(f"the gateway did not list every worker within {REGISTER_TIMEOUT_S:.0f} s: "
                       f"want {sorted(wanted)}, saw {seen}")


def _wait_registered(stack: Stack, metrics: bool) -> None:
    """Until the gateway lists every worker and, when they make a usable set, is ready to serve
    (its health monitor saw them too: the gateway boots beside the workers); then note every
    process's metrics port."""
    info = _wait_listed(stack, set(stack.addresses.values()))
    roles = set(stack.roles.values())
    decode_alone = _flag_value(stack.argv["gateway"], "--disaggregation", "always") != "always"
    if "both" in roles or {"prefill", "decode"} <= roles or ("decode" in roles and decode_alone):
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while (status := gateway_health(stack)) != health_pb2.HealthCheckResponse.SERVING:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway was not ready within {REGISTER_TIMEOUT_S:.0f} s of listing every "
                                   f"worker: {status}")
            time.sleep(0.1)
    if metrics:
        by_address = {address: name for name, address in stack.addresses.items()}
        for w in info.workers:
            name = "gateway" if w.role == "gateway" else by_address.get(w.address)
            if name is not None and w.metrics_address:
                stack.metrics_ports[name] = int(w.metrics_address.rsplit(":", 1)[1])
                stack.metrics_addresses[name] = w.metrics_address


# ---- worker pages --------------------------------------------------------------------------

_INFO_METHODS = ("/splitserve.v1.DecodeWorker/GetWorkerInfo", "/splitserve.v1.PrefillWorker/GetWorkerInfo")


def worker_info(target, timeout_s: float = 10.0) -> generation_pb2.WorkerInfo:
    """GetWorkerInfo of a worker, given its stub or its ``host:port`` (either service)."""
    if not isinstance(target, str):
        return target.GetWorkerInfo(worker_pb2.WorkerInfoRequest(), timeout=timeout_s)
    with grpc.insecure_channel(target) as channel:
        for method in _INFO_METHODS:
            call = channel.unary_unary(method, request_serializer=worker_pb2.WorkerInfoRequest.SerializeToString,
                                       response_deserializer=generation_pb2.WorkerInfo.FromString)
            try:
                return call(worker_pb2.WorkerInfoRequest(), timeout=timeout_s)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
    raise RuntimeError(f"{target} serves neither worker service")


def wait_free_pages(target, expected: int, timeout_s: float = 15.0) -> generation_pb2.WorkerInfo:
    """Until a worker (stub or ``host:port``) has ``expected`` free pages and nothing running;
    AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = worker_info(target)
        if info.kv_blocks_free == expected and info.num_running == 0:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"free pages {info.kv_blocks_free} (running {info.num_running}) never returned "
                                 f"to {expected} within {timeout_s:.0f} s")
        time.sleep(0.1)


def kv_free_blocks(target) -> int:
    """Free KV pages (prefix-cached ones count as free) of a worker: stub or ``host:port``."""
    return worker_info(target).kv_blocks_free


def wait_pages_at_baseline(stack: Stack, baseline: dict[str, int], timeout_s: float = 30.0,
                           names: Iterable[str] | None = None) -> dict[str, generation_pb2.WorkerInfo]:
    """Until every worker in ``names`` (default: every worker in ``baseline``) has exactly its
    baseline of free pages and nothing running or waiting. Raises AssertionError after
    ``timeout_s`` naming each worker that is off (free/baseline, running, waiting)."""
    names = list(baseline if names is None else names)
    deadline = time.monotonic() + timeout_s
    while True:
        infos = {name: worker_info(stack.worker_stub(name)) for name in names}
        off = {name: i for name, i in infos.items()
               if i.kv_blocks_free != baseline[name] or i.num_running or i.num_waiting}
        if not off:
            return infos
        if time.monotonic() > deadline:
            detail = ", ".join(f"{n}: free {i.kv_blocks_free}/{baseline[n]} (total {i.kv_blocks_total}), "
                               f"running {i.num_running}, waiting {i.num_waiting}" for n, i in off.items())
            raise AssertionError(f"KV pages not back at baseline after {timeout_s:.0f} s: {detail}")
        time.sleep(0.1)


def gateway_health(stack: Stack, timeout_s: float = 5.0):
    """The readiness of the stack's gateway (grpc.health.v1 ``splitserve.v1.Generation``: can it
    serve a request now?), or the code of the failed check."""
    return health(stack.client.channel, timeout_s, service="splitserve.v1.Generation")


def health(target, timeout_s: float = 5.0, service: str = ""):
    """grpc.health.v1 status of ``service`` on a server (its ``host:port`` or a channel to it), or
    the status code of the failed check (UNAVAILABLE when nothing answers). The default, ``""``,
    asks whether the process is alive; its own service name, whether it is ready to serve."""
    from grpc_health.v1 import health_pb2_grpc
    channel = grpc.insecure_channel(target) if isinstance(target, str) else target
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=timeout_s).status
    except grpc.RpcError as e:
        return e.code()
    finally:
        if isinstance(target, str):
            channel.close()


# ---- Redis ----------------------------------------------------------------------------------

def _redis_client(redis_or_server):
    return redis_or_server.client() if isinstance(redis_or_server, RedisServer) else redis_or_server


def live_request_keys(redis_or_server, prefix: str = "ss") -> list[str]:
    """Request hashes without a TTL, i.e. of requests not (yet) in a terminal state
    (splitserve/state/store.py expires a request's hash once it is terminal)."""
    r = _redis_client(redis_or_server)
    return sorted(k for k in r.scan_iter(f"{{{prefix}}}:req:*", count=1000) if r.ttl(k) == -1)


def wait_redis_clean(redis_or_server, timeout_s: float = 60.0) -> tuple[list[str], dict[str, list[str]]]:
    """Until Redis holds no live request and both queues are empty, or ``timeout_s`` passed;
    returns what is left (live request keys, queue contents)."""
    give_up = time.monotonic() + timeout_s
    while True:
        live, queues = live_request_keys(redis_or_server), queued_request_ids(redis_or_server)
        if (not live and not any(queues.values())) or time.monotonic() > give_up:
            return live, queues
        time.sleep(0.5)


def queued_request_ids(redis_or_server, prefix: str = "ss") -> dict[str, list[str]]:
    """Ids in the pending and in-flight queues: ``{"pending": [...], "inflight": [...]}``."""
    r = _redis_client(redis_or_server)
    return {name: list(r.zrange(f"{{{prefix}}}:q:{name}", 0, -1)) for name in ("pending", "inflight")}
