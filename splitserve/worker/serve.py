"""A worker process's life: serve, register and beat, watch the engine, drain on SIGTERM.

    return run_worker(servicer, worker_pb2_grpc.add_DecodeWorkerServicer_to_server,
                      "splitserve.v1.DecodeWorker", args)

``args`` carries the server flags of ``splitserve.cli`` (host, port, advertise_host,
no_reflection, redis_url, redis_password, drain_timeout_s and the security flags: the port
takes TLS and ``--internal-token``, see ``worker_security``).
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import time

from splitserve.common.aio import wait_for
from splitserve.common.gc_heap import freeze_startup_heap
from splitserve.common.grpc_server import advertised, set_dead, set_health, start_server, stop_event
from splitserve.common.huge_pages import settle_in_huge_pages
from splitserve.common.security import Security
from splitserve.worker.heartbeat import Heartbeat, engine_stats
from splitserve.worker.prefix_publisher import PrefixPublisher
from splitserve.worker.servicer import WorkerServicer

log = logging.getLogger(__name__)

# How often the process checks that its engine loop is still alive (and not stalled).
WATCH_S = 0.5


def run_worker(servicer: WorkerServicer, add_to_server, service_name: str, args) -> int:
    """Serve until SIGTERM/SIGINT (exit 0 after a drain) or until the engine dies (exit 1, so a
    supervisor restarts the worker)."""
    code = asyncio.run(_serve(servicer, add_to_server, service_name, args))
    if code != 0:
        _exit_without_native_teardown(code)
    return code


def _exit_without_native_teardown(code: int) -> None:
    """End a worker whose engine died, skipping the C++ side of interpreter shutdown.

    What killed the engine is often still in native code: a tensor-parallel process group whose
    peer is gone, a step thread still inside a collective. Tearing those down at exit can abort
    the process (SIGABRT: a rank killed with -9 once left its worker exiting -6, not 1), and a
    supervisor must see the exit code this function is given. Python's own exit work (atexit
    handlers, weakref finalizers: temporary directories) still runs, and logs are flushed."""
    import atexit
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def lora_modules(value: str) -> list[tuple[str, str]]:
    """``--lora-modules``: "name=path,name2=path2" -> [(name, path), ...] (SystemExit naming a bad one)."""
    pairs = []
    for item in filter(None, (part.strip() for part in (value or "").split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise SystemExit(f"splitserve: --lora-modules: {item!r} is not name=path")
        pairs.append((name.strip(), path.strip()))
    return pairs


def load_loras(engine, value: str) -> None:
    """Add the ``--lora-modules`` adapters to ``engine`` (SystemExit naming one that does not fit)."""
    for name, path in lora_modules(value):
        try:
            engine.add_lora(name, path)
        except ValueError as e:
            raise SystemExit(f"splitserve: --lora-modules {name}={path}: {e}") from None


def report_huge_pages(settled) -> None:
    if settled.skipped:
        log.info("huge pages: not used (%s)", settled.skipped)
    else:
        log.info("huge pages: %d of %d MiB of anonymous memory in them (%d before; resident +%d MiB, %.1f s)",
                 settled.huge_after >> 20, settled.anonymous_after >> 20, settled.huge_before >> 20,
                 (settled.anonymous_after - settled.anonymous_before) >> 20, settled.seconds)


async def _serve(servicer: WorkerServicer, add_to_server, service_name: str, args) -> int:
    load_loras(servicer.engine, getattr(args, "lora_modules", ""))  # before it registers: gateways route by them
    if getattr(args, "huge_pages", False):  # before it serves: it takes seconds, and no request must wait on it
        report_huge_pages(settle_in_huge_pages())

    def register(server):
        add_to_server(servicer, server)
        return [service_name]
    security = worker_security(args)
    server, health, port = await start_server(register, f"{args.host}:{args.port}",
                                              reflection_enabled=not args.no_reflection,
                                              security=security)
    servicer.address = advertised(args.host, args.advertise_host, port)
    heartbeat = publisher = None
    if args.redis_url:
        from splitserve.state.store import RedisState, make_async_client
        # Signed with the internal token's key: gateways that have the token route to no record
        # that lacks it, so a fake worker written into Redis gets nothing.
        state = RedisState(make_async_client(args.redis_url, password=args.redis_password or None),
                           registry_key=security.registry_key)
        from splitserve.common.locality import default_host_id
        # The host id tells the gateway which workers can reach each other over shm / cuda_ipc.
        stats = engine_stats(servicer.loop, servicer.engine.stats, {"metrics_address": servicer.metrics_address,
                                                                    "host_id": getattr(args, "host_id", "") or default_host_id()})
        heartbeat = Heartbeat(state, servicer.worker_id, servicer.role, servicer.address, servicer.transports,
                              stats=stats).start()
        if servicer.engine.config.enable_prefix_caching:
            # What this worker caches, for every gateway's placement (splitserve/state/prefixes.py).
            publisher = PrefixPublisher(state, servicer.worker_id, servicer.loop,
                                        servicer.engine.kv.holdings).start()
    freeze_startup_heap()  # the engine is built and warm: no full collection walks it again
    # The first line on stdout says where to connect (scripts, tests and `up` read it).
    print(f"{servicer.role} worker {servicer.worker_id} serving on {servicer.address}", flush=True)
    stop = stop_event()
    code = 0
    while not stop.is_set():
        try:
            await wait_for(stop.wait(), WATCH_S)
        except asyncio.TimeoutError:
            pass
        if not servicer.loop.alive:  # a dead engine must not keep answering SERVING
            log.error("engine loop died: %r; exiting so a supervisor restarts the worker", servicer.loop.error)
            code = 1
            break
        servicer.loop.report_stall()  # a step that does not end: logged once, with where it is
    servicer.draining = True  # refuse new work first: NOT_SERVING below promises it
    if code == 0:
        # Draining: not ready (gateways route nothing new here), still alive while it finishes.
        await set_health(health, [service_name], serving=False)
    else:
        await set_dead(health)  # a dead engine: a liveness check must not call this process alive
    log.info("stopping: not ready; leaving the registry")  # each step logged: a stuck shutdown says where
    if publisher is not None:
        await publisher.stop()  # before deregistering, which deletes what it published
    if heartbeat is not None:
        await heartbeat.stop()  # out of the registry: gateways route nothing new here
    if code == 0:
        await _drain(servicer, args.drain_timeout_s)
    await server.stop(grace=1)
    servicer.close()
    return code


def worker_security(args) -> Security:
    """A worker's port accepts only the gateway's ``--internal-token``. A client token given to a
    worker (an old configuration that handed ``--auth-token`` to every process) is refused: it
    would let every client call Reserve and Prefill here directly."""
    if getattr(args, "auth_token", ""):
        raise SystemExit("workers take --internal-token (SPLITSERVE_INTERNAL_TOKEN), the gateway's "
                         "credential, not the clients' --auth-token (SPLITSERVE_AUTH_TOKEN): give the token to the "
                         "gateway only, and one internal token to the gateway and every worker")
    return Security.internal_from_args(args)


async def _drain(servicer: WorkerServicer, timeout_s: float) -> None:
    """SIGTERM: with new work refused, let what is here finish (bounded), then stop."""
    give_up = time.monotonic() + timeout_s
    log.info("draining: finishing in-flight work for up to %.0f s", timeout_s)
    while time.monotonic() < give_up and servicer.loop.alive:
        if await servicer.idle():
            log.info("drained")
            return
        await asyncio.sleep(0.2)
    log.warning("drain timeout: stopping with work still in flight")


def engine_config(args):
    """The ``EngineConfig`` of a worker from its parsed flags (one flag per config field), after
    setting the engine's torch threads (``--num-threads``; 0 keeps torch's default)."""
    import dataclasses

    import torch

    from splitserve.engine.config import EngineConfig
    if getattr(args, "num_threads", 0) > 0:
        torch.set_num_threads(args.num_threads)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig(**values)
