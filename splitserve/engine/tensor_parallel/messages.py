"""What rank 0 sends its followers, and the one control-socket framing they share.

One message per step (``StepMessage``); a KV connector's set-up message once, when a worker
wires its connector (``splitserve.engine.kv_connector``); ``None`` to stop. Nothing is pickled (no
process unpickles, tests/service/test_security.py): a frame is a JSON document naming each value's
type from a fixed list, followed by the raw bytes of the tensors it refers to. The list holds the
engine's own types and those a KV connector registers (``register``) for its orders and set-up.
"""
from __future__ import annotations

import dataclasses
import json
import socket
import struct
from dataclasses import dataclass, fields
from typing import Any

import torch

from splitserve.engine.attention.backend import StepLayout

_LENGTH = struct.Struct("!Q")
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.int32, torch.int64, torch.float32, torch.bfloat16,
                                                       torch.float16, torch.uint8)}


@dataclass(frozen=True)
class StepMessage:
    swap_out: tuple = ()
    swap_in: tuple = ()
    # None: no forward this step (only swaps).
    input_ids: Any = None
    positions: Any = None
    layout: Any = None  # splitserve.engine.attention.StepLayout
    # The KV connector's orders for this step (``KVConnector.step_orders``): its registered types.
    kv_orders: tuple = ()

    @property
    def wants_reply(self) -> bool:
        """Ranks report what they could not ship after a step that gave them KV orders."""
        return bool(self.kv_orders)

    @classmethod
    def from_wire(cls, values: dict) -> "StepMessage":
        for name in ("swap_out", "swap_in"):
            values[name] = tuple(tuple(pair) for pair in values[name])
        values["kv_orders"] = tuple(values["kv_orders"])
        return cls(**values)


# A layout's tensors, which travel in the message; the rest of it is plain values.
_LAYOUT_TENSORS = ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")


def layout_on(layout: StepLayout, device: torch.device | str, copy: bool = False) -> StepLayout:
    """``layout`` with its tensors on ``device``; ``copy``: fresh tensors rather than views of
    the runner's persistent buffers (a view would carry its whole buffer into the message)."""
    return dataclasses.replace(layout, **{name: getattr(layout, name).to(device, copy=copy) for name in _LAYOUT_TENSORS})


# The types a frame may name: the engine's own, and those a KV connector registers.
_TYPES: dict[str, type] = {}


def register(cls: type) -> type:
    """Let ``cls`` (a dataclass, or a class with ``to_wire()`` and a ``from_wire(dict)``
    classmethod) travel between ranks; usable as a class decorator. A dataclass may also define
    ``from_wire(values)`` to restore what JSON flattened (tuples)."""
    _TYPES[cls.__name__] = cls
    return cls


register(StepMessage)
register(StepLayout)


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
    if _TYPES.get(kind) is not type(value):
        raise TypeError(f"cannot send a {kind} to a tensor-parallel rank")
    if hasattr(value, "to_wire"):
        return {"type": kind, "wire": value.to_wire()}
    return {"type": kind, "fields": {f.name: _encode(getattr(value, f.name), blobs) for f in fields(value)}}


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
    cls = _TYPES[doc["type"]]  # a KeyError for any other name: nothing else is built
    if "wire" in doc:
        return cls.from_wire(doc["wire"])
    values = {name: _decode(v, next_blob) for name, v in doc["fields"].items()}
    return cls.from_wire(values) if hasattr(cls, "from_wire") else cls(**values)
