"""Clients that do not read their streams, for tests of the gateway's bounds on unread output,
and a connection that goes silent (``Blackhole``), for tests of keepalive.

Bounded on purpose: loopback addresses only, a fixed number of streams, each with a deadline.
Their channel advertises a 1 KiB HTTP/2 window and never grows it (no BDP probing), so the
gateway's sends block after ~40 one-token messages; a default channel would take megabytes of
output into its own buffers before the gateway noticed anything.
"""
from __future__ import annotations

import select
import socket
import threading

import grpc

from splitserve.v1 import generation_pb2, generation_pb2_grpc

__all__ = ["SMALL_WINDOW", "Blackhole", "NeverReading", "loopback_channel"]

SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


def loopback_channel(address: str) -> grpc.Channel:
    """A channel with ``SMALL_WINDOW`` to a server on this machine (refuses any other address)."""
    host = address.rsplit(":", 1)[0]
    if host not in ("127.0.0.1", "localhost", "[::1]"):
        raise ValueError(f"hostile test clients talk to loopback only, not {address!r}")
    return grpc.insecure_channel(address, options=SMALL_WINDOW)


class NeverReading:
    """``count`` Generate streams opened at once on one channel and never read.

    ``calls[i]`` is the i-th stream (request id ``f"{tag}-{i}"``); each ends by its ``timeout_s``
    at the latest. ``close()`` cancels whatever is still open and closes the channel.
    """

    def __init__(self, address: str, count: int, prompt: list[int], max_tokens: int, tag: str = "unread",
                 timeout_s: float = 120.0, stream_interval: int = 0, logprobs: int = 0):
        if not 0 < count <= 200:
            raise ValueError(f"a bounded hostile client opens 1..200 streams, not {count}")
        self.channel = loopback_channel(address)
        stub = generation_pb2_grpc.GenerationStub(self.channel)
        sampling = generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                 logprobs=logprobs)
        self.request_ids = [f"{tag}-{i}" for i in range(count)]
        # A unary-stream call starts at once; its messages are only pulled when iterated.
        self.calls = [stub.Generate(generation_pb2.GenerateRequest(request_id=rid, token_ids=prompt,
                                                                   sampling=sampling, stream_interval=stream_interval),
                                    timeout=timeout_s)
                      for rid in self.request_ids]

    def read_one(self, index: int = 0) -> tuple[int, grpc.StatusCode, str]:
        """Read stream ``index`` to its end now: (messages read, status code, details)."""
        n = 0
        try:
            for _ in self.calls[index]:
                n += 1
        except grpc.RpcError as e:
            return n, e.code(), e.details() or ""
        return n, grpc.StatusCode.OK, ""

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        self.channel.close()

    def __enter__(self) -> "NeverReading":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Blackhole:
    """A loopback TCP relay to ``target`` that can go silent: after ``freeze()`` no byte moves in
    either direction, yet every socket stays open -- no FIN, no RST -- as when a client loses power
    or a cable is cut. Only a keepalive ping that gets no answer tells the server.

    ``address`` is where clients connect; ``close()`` closes everything.
    """

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        if host not in ("127.0.0.1", "localhost"):
            raise ValueError(f"a black hole relays to loopback only, not {target!r}")
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.frozen = threading.Event()
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, name="blackhole-accept", daemon=True).start()

    def freeze(self) -> None:
        self.frozen.set()

    def close(self) -> None:
        self.closed.set()
        for sock in self.sockets:
            sock.close()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            threading.Thread(target=self._relay, args=(client, upstream), name="blackhole-relay", daemon=True).start()

    def _relay(self, a: socket.socket, b: socket.socket) -> None:
        peer = {a: b, b: a}
        while not self.closed.is_set() and not self.frozen.is_set():
            try:
                readable, _, _ = select.select([a, b], [], [], 0.05)
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    peer[sock].sendall(data)
            except OSError:
                return
