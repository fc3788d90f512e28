"""The tcp KV transport's frames: header layout, frame types, reading exactly N bytes, and the byte
views of pages both ends send and receive.

Shared by the data path (``tcp``) and the connection handshake (``tcp_auth``); the format
itself is described in ``splitserve/kvtransfer/transports/tcp.py``.
"""
from __future__ import annotations

import socket
import struct

import torch

from splitserve.engine.attention.kv_quant import as_bytes

MAGIC = b"SSKV"
VERSION = 2
HEADER = struct.Struct("!4sBBBHqIIIQ")
WRITE, FLUSH, ACK, ERROR, PACKED = 1, 2, 3, 4, 5
# A run of pages, some of their KV heads only (workers split over different numbers of ranks).
HEADS = 9
# The handshake of a receiver with a secret (``tcp_auth``): sender HELLO, receiver CHALLENGE, sender AUTH.
HELLO, CHALLENGE, AUTH = 6, 7, 8
STALE, EXPIRED, ABORTED = 1, 2, 3
MAX_RID_BYTES = 1024
MAX_MESSAGE_BYTES = 64 << 10


class ProtocolError(Exception):
    """A frame from the network that breaks the wire format: the connection is closed."""


class PeerGone(Exception):
    """The peer closed the connection or made no progress within the timeout."""


class PeerTimeout(PeerGone):
    """No progress within the socket timeout."""


def frame(ftype: int, rid: bytes, epoch: int, layer: int = 0, dst: int = 0, num: int = 0,
          payload_len: int = 0, kind: int = 0) -> bytes:
    """Header plus request id of one frame (the payload is sent after it)."""
    return HEADER.pack(MAGIC, VERSION, ftype, kind, len(rid), epoch, layer, dst, num, payload_len) + rid


def recv_exact(sock: socket.socket, view: memoryview, idle_ok: bool = False) -> bool:
    """Fill ``view`` from ``sock``. With ``idle_ok``, a timeout before the first byte returns False."""
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except socket.timeout:
            if idle_ok and got == 0:
                return False
            raise PeerTimeout(f"no data for {sock.gettimeout()} s") from None
        except OSError as e:
            raise PeerGone(f"connection lost ({e})") from None
        if n == 0:
            raise PeerGone("connection closed by the peer" + (" in the middle of a frame" if got else ""))
        got += n
    return True


def byte_view(t: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU tensor, no copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def page_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., pages, bs, H, D] as one row of 16-byte elements per page where the strides allow (else ``t``):
    index_select / index_copy_ move those bit for bit, several times faster than 2-byte elements."""
    try:
        return t.view(*t.shape[:-3], -1).view(torch.uint8).view(torch.complex128)
    except RuntimeError:
        return as_bytes(t)  # fp8 pages as bytes: CPU index_copy_ takes no fp8


def flat_view(pool: torch.Tensor) -> memoryview | None:
    """All bytes of a contiguous CPU pool (pages are sliced out by offset), else None."""
    return byte_view(pool) if pool.is_contiguous() and pool.device.type == "cpu" else None
