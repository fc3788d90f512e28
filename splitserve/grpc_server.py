"""Every splitserve gRPC server is built the same way: error mapping, health, reflection."""
from __future__ import annotations

from concurrent import futures
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitserve.errors import ErrorMappingInterceptor

# Generous message limits: KV descriptors and long prompts are small, but stay bounded.
MAX_MESSAGE_BYTES = 16 * 2**20


def build_server(register: Callable[[grpc.Server], Iterable[str]], address: str, max_workers: int = 64,
                 reflection_enabled: bool = True) -> tuple[grpc.Server, health.HealthServicer, int]:
    """A started server at ``address`` ("host:port", port 0 picks one); returns (server, health, port).

    ``register`` adds the servicers and returns their full service names.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         interceptors=[ErrorMappingInterceptor()],
                         options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    names = list(register(server))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in names + [""]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if reflection_enabled:
        reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    server.start()
    return server, health_servicer, port
