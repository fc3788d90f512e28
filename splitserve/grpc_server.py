"""Every splitserve gRPC server is built the same way: security, error mapping, health, reflection."""
from __future__ import annotations

import logging
from concurrent import futures
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitserve.errors import ErrorMappingInterceptor
from splitserve.security import Security

log = logging.getLogger(__name__)


def build_server(register: Callable[[grpc.Server], Iterable[str]], address: str, max_workers: int = 64,
                 reflection_enabled: bool = True,
                 security: Security | None = None) -> tuple[grpc.Server, health.HealthServicer, int]:
    """A started server at ``address`` ("host:port", port 0 picks one); returns (server, health, port).

    ``register`` adds the servicers and returns their full service names. ``security`` (default:
    plaintext, no token, 16 MiB messages) decides TLS/mutual TLS of the port, the bearer token and
    the message limit. The error mapping comes first so a refused token surfaces as
    ``UNAUTHENTICATED`` through the same mapping as every other error.
    """
    security = security or Security()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         interceptors=[ErrorMappingInterceptor(), *security.server_interceptors()],
                         options=security.message_options())
    names = list(register(server))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in names + [""]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if reflection_enabled:
        reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    credentials = security.server_credentials()
    if credentials is None:
        if security.ca is not None:
            log.warning("--tls-ca without --tls-cert/--tls-key: %s serves plaintext (the CA only verifies "
                        "the servers this process calls)", address)
        if security.token:
            log.warning("--auth-token without TLS: the token crosses the network in clear text")
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    server.start()
    log.info("gRPC on %s: %s, token %s, messages up to %d MiB", address,
             "mutual TLS" if security.mutual_tls else "TLS" if security.server_tls else "plaintext",
             "required" if security.token else "off", security.max_message_bytes // 2**20)
    return server, health_servicer, port
