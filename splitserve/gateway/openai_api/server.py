"""uvicorn serving the HTTP API on the gateway's own event loop (beside the gRPC server)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from splitserve.common.aio import wait_for


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


class BodyLimits:
    """ASGI middleware: a request's body is read here, before the application sees any of it, up
    to ``max_bytes`` (413 past it: a declared Content-Length at once, a chunked body as soon as it
    passes) and within ``timeout_s`` from the request's start (408 after: a client that uploads a
    byte now and then holds a connection and its buffer no longer). The application then gets it
    in one piece; later ``receive`` calls (a client's disconnect, watched while streaming) go
    through unchanged. Without it, a multi-GB body would be read and parsed, several times over,
    before any size check."""

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _answer(send, 413, f"the request body ({int(declared)} bytes) is larger than "
                                            f"{self.max_bytes} bytes (--max-message-mb)")
        body, loop = bytearray(), asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            try:
                message = await wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return await _answer(send, 408, f"the request body did not arrive within {self.timeout_s:g} s "
                                                "(--http-body-timeout-s)")
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await _answer(send, 413, f"the request body is larger than {self.max_bytes} bytes "
                                                "(--max-message-mb)")
            if not message.get("more_body"):
                break
        whole = {"type": "http.request", "body": bytes(body), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()

        return await self.app(scope, replay, send)


def _error_body(status: int, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status}}).encode()


async def _answer(send, status: int, message: str) -> None:
    """An OpenAI-style error body, and the connection closed (what is left of the body is not read)."""
    body = _error_body(status, message)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def no_delay(transport) -> None:
    """Every write goes out at once (TCP_NODELAY). asyncio sets it on the connections of servers it
    makes, but not on those accepted from a socket made by ``socket.create_server`` (``bind``:
    its protocol number is 0, not IPPROTO_TCP, and asyncio checks for that). Without it, Nagle's
    algorithm held each write made while an earlier one was unacknowledged until the client's
    delayed ACK came, 40 ms later: every non-streamed answer (its body is a second write after
    the headers) took 44 ms on loopback against vLLM serve's 0.4, and a stream's first token
    waited behind its headers' ACK where the prompt took under 40 ms."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):  # a peer that reset at once: nothing left to send to
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol (what its "auto" picks without httptools, which splitserve does not
    install) with a deadline on each request's line and headers: ``header_timeout_s`` from the
    connection's start, or from the previous response's end on a kept-alive connection. uvicorn
    has none (its keep-alive timer stops at a request's first byte), so a client that sends
    nothing, or a header byte now and then, held one of the --http-max-connections slots for
    good. Past the deadline the connection is closed: with a 408 if part of a request came; with
    nothing if none did (a 408 on an idle connection could pass for the answer to a request the
    client is sending at that moment). Once the headers are in, the body has BodyLimits' timeout."""

    header_timeout_s = 10.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)
        no_delay(transport)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._header_timer.cancel()
        if not self.transport.is_closing():  # the next request on this connection gets its own deadline
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        self._header_timer.cancel()

    def _headers_late(self) -> None:
        # h11 leaves IDLE once a request's headers are parsed, and returns to it only for the next one.
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        partial, _ = self.conn.trailing_data
        if partial:
            body = _error_body(408, f"the request's headers did not arrive within {self.header_timeout_s:g} s "
                                    "(--http-header-timeout-s)")
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        self.transport.close()


class HttpServer:
    def __init__(self, app, sock: socket.socket, ssl_certfile: str = "", ssl_keyfile: str = "", ssl_ca: str = "",
                 max_connections: int = 2048, max_body_bytes: int = 16 << 20, body_timeout_s: float = 30.0,
                 header_timeout_s: float = 10.0):
        """``sock``: from ``bind``. With ``ssl_ca`` (and a certificate), clients must present a
        certificate it signed, as on the gRPC port. ``max_connections``: connections served at once
        (one more gets 503 at once); request headers are bounded by ``HeaderDeadline``, bodies by
        ``BodyLimits``."""
        # uvicorn makes one protocol object per connection from a class: this server's, with its timeout.
        protocol = type("HeaderDeadline", (HeaderDeadline,), {"header_timeout_s": header_timeout_s})
        config = uvicorn.Config(BodyLimits(app, max_body_bytes, body_timeout_s), http=protocol, log_level="warning",
                                access_log=False, lifespan="off",
                                ssl_certfile=ssl_certfile or None, ssl_keyfile=ssl_keyfile or None,
                                ssl_ca_certs=ssl_ca or None,
                                ssl_cert_reqs=ssl.CERT_REQUIRED if ssl_ca and ssl_certfile else ssl.CERT_NONE,
                                timeout_graceful_shutdown=2, limit_concurrency=max_connections)
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
