"""Every splitserve gRPC server is built the same way: asyncio, security, error mapping, health, reflection.

The servers are ``grpc.aio`` servers: an open stream is a suspended coroutine, not a thread,
so a process holds thousands of them and a health check is answered between two messages of
any stream. Handlers must never block the event loop (the engines run on their own thread,
see ``splitserve.worker.engine_loop``).

grpc.health.v1 answers two questions apart, as a liveness and a readiness probe ask them:

* ``""`` (the empty service name): *is the process alive?* SERVING from the start until it
  exits, draining included; NOT_SERVING only once a worker's engine died (it exits next). A
  failed liveness check is a reason to restart the process.
* the process's own service (``splitserve.v1.Generation`` on a gateway, ``splitserve.v1.DecodeWorker``
  or ``splitserve.v1.PrefillWorker`` on a worker): *is it ready to serve?* A gateway only while
  Redis answers and a usable set of workers is registered; a worker once its engine is loaded
  (its port opens only then); neither while draining. A failed readiness check is a reason to
  send traffic elsewhere, not to restart.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitserve.common.errors import ErrorMappingInterceptor
from splitserve.common.grpc_options import server_options
from splitserve.common.security import Security

log = logging.getLogger(__name__)

# gRPC core cancels calls that arrived but that the (Python) server has not picked up yet: once
# more than 1,000 wait (randomly, all past 3,000), and any that waited 30 s, answering CANCELLED
# with no reason. The aio server picks up one call per event-loop turn, so a burst of 2,000
# streams on a busy gateway lost 10-20 % that way (bench/health_under_load.py found it).
# Admission control is the gateway's queue limit, which answers RESOURCE_EXHAUSTED with a retry
# hint, and every wait of a request has its own bound: the transport lets a burst through.
BACKLOG_OPTIONS = [("grpc.server.max_pending_requests", 20_000),
                   ("grpc.server.max_pending_requests_hard_limit", 50_000),
                   ("grpc.server_max_unrequested_time_in_server", 600)]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

LIVENESS = ""  # grpc.health.v1's name for the server as a whole
GENERATION = "splitserve.v1.Generation"
DECODE_WORKER = "splitserve.v1.DecodeWorker"
PREFILL_WORKER = "splitserve.v1.PrefillWorker"
# The readiness service of a worker, by role (a colocated worker serves DecodeWorker).
WORKER_SERVICES = {"prefill": PREFILL_WORKER, "decode": DECODE_WORKER, "both": DECODE_WORKER}


async def start_server(register: Callable[[grpc.aio.Server], Iterable[str]], address: str,
                       reflection_enabled: bool = True, security: Security | None = None,
                       ready: bool = True) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """A started server at ``address`` ("host:port", port 0 picks one); returns (server, health, port).

    ``register`` adds the servicers and returns their full service names: SERVING at once when
    ``ready``, else NOT_SERVING until ``set_health`` says otherwise; liveness (``""``) is SERVING
    either way. ``security`` (default:
    plaintext, no token, 16 MiB messages) decides TLS/mutual TLS of the port, the bearer token and
    the message limit. The error mapping comes first so a refused token surfaces as
    ``UNAUTHENTICATED`` through the same mapping as every other error.
    """
    security = security or Security()
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor(), *security.server_interceptors()],
                             options=security.message_options() + BACKLOG_OPTIONS + server_options())
    names = list(register(server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set(LIVENESS, SERVING)
    await set_health(health_servicer, names, serving=ready)
    if reflection_enabled:
        reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    credentials = security.server_credentials()
    if credentials is None:
        if security.ca is not None:
            log.warning("--tls-ca without --tls-cert/--tls-key: %s serves plaintext (the CA only verifies "
                        "the servers this process calls)", address)
        if security.accepted_tokens:
            log.warning("--auth-token without TLS: the token crosses the network in clear text")
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    log.info("gRPC on %s: %s, token %s, messages up to %d MiB", address,
             "mutual TLS" if security.mutual_tls else "TLS" if security.server_tls else "plaintext",
             "required" if security.accepted_tokens else "off", security.max_message_bytes // 2**20)
    return server, health_servicer, port


def advertised(host: str, advertise_host: str, port: int) -> str:
    """The address other processes reach a server at (``--advertise-host``, else ``--host``)."""
    host = advertise_host or host
    return f"{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"


def stop_event() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (call on the running event loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def set_health(health_servicer, services: Iterable[str], serving: bool) -> None:
    """Readiness of ``services``; liveness (``""``) is left as it is: a process that cannot serve
    now (no workers, Redis down, draining) is still alive."""
    for name in services:
        await health_servicer.set(name, SERVING if serving else NOT_SERVING)


async def set_dead(health_servicer) -> None:
    """Neither alive nor ready, for good: the process is about to exit on a fatal error."""
    await health_servicer.enter_graceful_shutdown()
