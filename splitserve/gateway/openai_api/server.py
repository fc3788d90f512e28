"""uvicorn serving the HTTP API on the gateway's own event loop (beside the gRPC server)."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl

import uvicorn


# Kernel send buffer of each HTTP connection: SSE events are small; this is many of them.
SEND_BUFFER_BYTES = 64 * 1024


class _Server(uvicorn.Server):
    # The gateway owns SIGTERM/SIGINT (its drain): uvicorn must not install its own handlers.
    @contextlib.contextmanager
    def capture_signals(self):
        yield


def bind(host: str, port: int) -> socket.socket:
    """The HTTP API's listening socket (port 0: any free one). Bound before anything else of the
    gateway starts, so a port in use stops the process at once with a clear message."""
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise SystemExit(f"splitserve: --http-port {port}: cannot listen on {host}:{port}: {e.strerror}") from None
    # Connections inherit a fixed send buffer: left to autotuning, the kernel took a whole
    # 900-token stream (~600 KB) for a client that never read, so its request ran to the end
    # holding its pages, unseen by the slow-reader bound (splitserve/gateway/backpressure.py).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    return sock


class HttpServer:
    def __init__(self, app, sock: socket.socket, ssl_certfile: str = "", ssl_keyfile: str = "", ssl_ca: str = ""):
        """``sock``: from ``bind``. With ``ssl_ca`` (and a certificate), clients must present a
        certificate it signed, as on the gRPC port."""
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                ssl_certfile=ssl_certfile or None, ssl_keyfile=ssl_keyfile or None,
                                ssl_ca_certs=ssl_ca or None,
                                ssl_cert_reqs=ssl.CERT_REQUIRED if ssl_ca and ssl_certfile else ssl.CERT_NONE,
                                timeout_graceful_shutdown=2)
        self._server = _Server(config)
        self._socket = sock
        self.port = sock.getsockname()[1]
        self._task: asyncio.Task | None = None

    async def start(self) -> "HttpServer":
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._socket]),
                                                            name="http-server")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
            await asyncio.sleep(0.01)
        return self

    async def stop(self) -> None:
        """Stop taking connections; open streams get uvicorn's short grace (the gateway drained them)."""
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        self._socket.close()
