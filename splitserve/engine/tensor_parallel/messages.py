"""What rank 0 sends its followers, and the one control-socket framing they share.

One message per step (``StepMessage``); a ``KVSetup`` once, when a kvtransfer connector wires
the worker; ``None`` to stop. Nothing is pickled (no process unpickles, tests/service/test_security.py):
a frame is a JSON document naming each value's type from a fixed list, followed by the raw bytes of
the tensors it refers to.
"""
from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass, fields
from typing import Any

import torch

_LENGTH = struct.Struct("!Q")
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.int32, torch.int64, torch.float32, torch.bfloat16,
                                                       torch.float16, torch.uint8)}


@dataclass(frozen=True)
class CopyOrder:
    """Ship this step's pages of one prefill transfer: rank r writes its own slice of ``runs`` of
    every layer into decode rank r's pages, over ``transport`` (the one rank 0 picked)."""

    desc: Any  # splitserve.kvtransfer.base.TransferDescriptor, with the decode ranks' offers
    transport: str
    runs: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class StepMessage:
    swap_out: tuple = ()
    swap_in: tuple = ()
    # None: no forward this step (only swaps).
    input_ids: Any = None
    positions: Any = None
    layout: Any = None  # splitserve.engine.attention.StepLayout
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


def encode(obj: Any) -> bytes:
    """One frame: the JSON document's length and text, then each tensor's length and bytes."""
    blobs: list[bytes] = []
    doc = json.dumps(_encode(obj, blobs)).encode()
    return b"".join([_LENGTH.pack(len(doc)), doc, *(_LENGTH.pack(len(b)) + b for b in blobs)])


def send(sock: socket.socket, obj: Any) -> None:
    sock.sendall(encode(obj))


def recv(sock: socket.socket) -> Any:
    """The next object; EOFError when the peer closed the socket (its process ended)."""
    (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    doc = json.loads(_recv_exact(sock, length))
    return _decode(doc, lambda: _recv_exact(sock, _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))[0]))


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


def _types() -> dict[str, type]:
    from splitserve.engine.attention.backend import StepLayout
    return {"StepMessage": StepMessage, "CopyOrder": CopyOrder, "KVSetup": KVSetup, "StepLayout": StepLayout}


def _encode(value: Any, blobs: list[bytes]) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        blobs.append(value.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
        return {"tensor": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, (list, tuple)):
        return [_encode(v, blobs) for v in value]
    if isinstance(value, dict):
        return {"dict": [[k, _encode(v, blobs)] for k, v in value.items()]}
    kind = type(value).__name__
    if kind == "TransferDescriptor":
        return {"descriptor": value.to_dict()}
    if kind in _types():
        return {"type": kind, "fields": {f.name: _encode(getattr(value, f.name), blobs) for f in fields(value)}}
    raise TypeError(f"cannot send a {kind} to a tensor-parallel rank")


def _decode(doc: Any, next_blob) -> Any:
    if isinstance(doc, list):
        return [_decode(v, next_blob) for v in doc]
    if not isinstance(doc, dict):
        return doc
    if "tensor" in doc:
        raw = bytearray(next_blob())
        if not raw:
            return torch.empty(doc["shape"], dtype=_DTYPES[doc["tensor"]])
        return torch.frombuffer(raw, dtype=torch.uint8).view(_DTYPES[doc["tensor"]]).reshape(doc["shape"])
    if "bytes" in doc:
        return bytes.fromhex(doc["bytes"])
    if "dict" in doc:
        return {k: _decode(v, next_blob) for k, v in doc["dict"]}
    if "descriptor" in doc:
        from splitserve.kvtransfer.base import TransferDescriptor
        return TransferDescriptor.from_dict(doc["descriptor"])
    cls = _types()[doc["type"]]  # a KeyError for any other name: nothing else is built
    values = {name: _decode(v, next_blob) for name, v in doc["fields"].items()}
    if cls is CopyOrder:
        values["runs"] = tuple(tuple(run) for run in values["runs"])
    elif cls is StepMessage:
        for name in ("swap_out", "swap_in", "copies"):
            values[name] = tuple(tuple(v) if name != "copies" else v for v in values[name])
    elif cls is KVSetup:
        values["transports"] = tuple(values["transports"])
    return cls(**values)
