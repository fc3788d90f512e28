"""Serving a stand-in decode worker inside a test of one gateway class (the Dispatcher's tests):
a real gRPC server on loopback with the health service, whose DecodeWorker the test writes; and
the end of such a test."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from splitserve.v1 import worker_pb2_grpc


async def serve_decode_worker(servicer: worker_pb2_grpc.DecodeWorkerServicer) -> tuple[grpc.aio.Server, str]:
    """Start ``servicer`` on a free loopback port: (the server, its address)."""
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def stop_dispatcher(dispatcher, state, *servers: grpc.aio.Server) -> None:
    """The end of a Dispatcher test: the dispatcher, its worker channels, the stand-in servers,
    the Redis client."""
    await dispatcher.stop()
    await dispatcher.directory.close()
    for server in servers:
        await server.stop(None)
    await state.client.aclose()
