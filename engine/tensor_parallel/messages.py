"""What rank 0 sends its followers, and the one control-socket framing they share.

One message per step (``StepMessage``); a ``KVSetup`` once, when a kvtransfer connector wires
the worker; ``None`` to stop. Pickled with the standard pickler (tensors by value: the
multiprocessing pickler would try to share their memory through file descriptors instead).
"""
from __future__ import annotations

import pickle
import socket
import struct
from dataclasses import dataclass
from typing import Any

_LENGTH = struct.Struct("!Q")


@dataclass(frozen=True)
class CopyOrder:
    """Ship this step's pages of one prefill transfer: rank r writes its own slice of ``runs`` of
    every layer into decode rank r's pages, over ``transport`` (the one rank 0 picked)."""

    desc: Any  # kvtransfer.base.TransferDescriptor, with the decode ranks' offers
    transport: str
    runs: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class StepMessage:
    swap_out: tuple = ()
    swap_in: tuple = ()
    # None: no forward this step (only swaps).
    input_ids: Any = None
    positions: Any = None
    layout: Any = None  # engine.attention.StepLayout
    copies: tuple[CopyOrder, ...] = ()

    @property
    def wants_reply(self) -> bool:
        """Ranks report their copies' errors after a step that shipped pages."""
        return bool(self.copies)


@dataclass(frozen=True)
class KVSetup:
    """Wire the followers' pools to kvtransfer: ``serve`` (decode: open receivers beside rank 0's,
    fenced by rank 0's page-owner table) or ``send`` (prefill: senders made on demand)."""

    role: str  # "serve" | "send"
    transports: tuple[str, ...]
    owners_path: str = ""
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    kv_key: bytes | None = None


def send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv(sock: socket.socket) -> Any:
    """The next object; EOFError when the peer closed the socket (its process ended)."""
    (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    return pickle.loads(_recv_exact(sock, length))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the peer rank closed its control socket")
        got += k
    return bytes(buf)
