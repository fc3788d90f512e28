"""Same host, GPUs: the decode pool is exported through a CUDA IPC handle and written by
device-to-device copies from the prefill process.

The decode side publishes, in a shared-memory directory (as the shm transport does), the
page-owner table and the pool's IPC handle, produced by torch's own CUDA tensor sharing
(`torch.multiprocessing.reductions`) and written as JSON (never pickle): only the classes
torch puts in such a handle are accepted back. The prefill side opens the handle, checks page
ownership before each layer like the shm sender, and copies between the two device pools
(``splitserve.kvtransfer.page_copy``: on one GPU one Triton kernel per layer, whatever the page
table; the prefill connector issues them on its own copy stream, so they overlap the next
layer's compute). A write does not wait for its copies: it records an event, and the pages'
locks are held until the device has passed it, so a writer whose lease was released stops at
its next layer exactly as on shm, no late copy lands in a page given to another request, and
``flush`` (hence "complete") comes only after every byte landed.

A handle that cannot be opened here (another host, another container's IPC/PID namespace, a GPU
this process does not see, a CPU-only process) raises ``TransportUnavailableError``, so the prefill
side falls back to the next transport the decode worker offers. Two processes on one GPU (the
single-GPU disaggregated mode) and pairs of GPUs in one machine both work; across containers
this needs shared IPC and PID namespaces (compose: ``ipc: service:...``, ``pid: service:...``).
"""
from __future__ import annotations

import base64
import threading
from pathlib import Path
from typing import Sequence

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from splitserve.kvtransfer.base import TransferDescriptor, TransportUnavailableError
from splitserve.kvtransfer.lease import LeaseTable
from splitserve.kvtransfer.transports.base import Run
from splitserve.kvtransfer.transports.shm import PoolDirectory, ShmReceiver, ShmSender, create_pool_directory


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# The classes ``reduce_tensor`` names in a CUDA tensor's handle: the tensor's own class and its
# storage's (``type(tensor._typed_storage())``, a TypedStorage). Nothing else is rebuilt.
_CLASSES = {_class_name(cls): cls for cls in (torch.Tensor, torch.storage.TypedStorage, torch.UntypedStorage)}


def _encode(value):
    if isinstance(value, bytes):
        return {"b64": base64.b64encode(value).decode()}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Size):
        return {"size": list(value)}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, type):
        if _class_name(value) not in _CLASSES:
            raise ValueError(f"cannot export a CUDA IPC handle naming {_class_name(value)}")
        return {"class": _class_name(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"cannot export {type(value).__name__} in a CUDA IPC handle")


def _decode(value):
    if isinstance(value, dict):
        if "b64" in value:
            return base64.b64decode(value["b64"])
        if "dtype" in value:
            dtype = getattr(torch, str(value["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype in a CUDA IPC handle: {value['dtype']!r}")
            return dtype
        if "size" in value:
            return torch.Size(value["size"])
        if "tuple" in value:
            return tuple(_decode(v) for v in value["tuple"])
        if "class" in value:
            if value["class"] not in _CLASSES:
                raise ValueError(f"unexpected class in a CUDA IPC handle: {value['class']}")
            return _CLASSES[value["class"]]
        raise ValueError(f"unexpected entry in a CUDA IPC handle: {sorted(value)}")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"unexpected {type(value).__name__} in a CUDA IPC handle")


def encode_handle(args: Sequence) -> list:
    """``reduce_tensor``'s arguments for ``rebuild_cuda_tensor`` as JSON-safe values."""
    return [_encode(a) for a in args]


def decode_handle(encoded: list) -> tuple:
    """The inverse of ``encode_handle``; ValueError for anything torch would not have put there."""
    if not isinstance(encoded, list):
        raise ValueError("a CUDA IPC handle is a JSON list")
    return tuple(_decode(a) for a in encoded)


def export_handle(pool: torch.Tensor) -> list:
    """The arguments that rebuild ``pool`` in another process, as JSON-safe values."""
    rebuild, args = reduce_tensor(pool)
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError("cuda_ipc needs a CUDA pool")
    return encode_handle(args)


class CudaIpcReceiver(ShmReceiver):
    name = "cuda_ipc"

    @classmethod
    def create(cls, pool: torch.Tensor, lease_ttl_s: float, clock) -> "CudaIpcReceiver":
        from splitserve.kvtransfer.lease import PageFence
        from splitserve.kvtransfer.page_locks import PageLocks
        owners, directory = create_pool_directory(pool.shape, pool.dtype, {"ipc": export_handle(pool)})
        fence = PageFence(owners, PageLocks(directory / "owners"))
        return cls(pool, LeaseTable(fence, lease_ttl_s, clock=clock), directory)


class CudaIpcSender(ShmSender):
    name = "cuda_ipc"

    def __init__(self, address: str, src_pool: torch.Tensor):
        if not src_pool.is_cuda:
            raise TransportUnavailableError("cuda_ipc copies from a CUDA pool; this worker's pool is on "
                                            f"{src_pool.device}")
        super().__init__(address, src_pool)
        self._in_flight_lock = threading.Lock()
        self._events: list[torch.cuda.Event] = []  # recorded after each write not yet known to have landed
        self._held: list[tuple[int, int]] = []  # the page ranges those writes locked

    def _map_pool(self, directory: PoolDirectory, meta: dict) -> torch.Tensor:
        try:
            pool = rebuild_cuda_tensor(*decode_handle(meta["ipc"]))
        except Exception as e:  # a bad handle, no CUDA, another namespace: this transport is not usable here
            raise TransportUnavailableError(
                f"cuda_ipc pool {directory.address} cannot be opened from this process ({type(e).__name__}: {e}); the "
                "decode worker must be on this host, share its IPC and PID namespaces and see the same GPU") from e
        if list(pool.shape) != list(meta["shape"]) or str(pool.dtype).removeprefix("torch.") != meta["dtype"]:
            raise TransportUnavailableError(f"cuda_ipc pool {directory.address}: the handle opens a {tuple(pool.shape)} "
                                            f"{pool.dtype} tensor, the directory says {meta['shape']} {meta['dtype']}")
        return pool

    def _release_when_landed(self, held: list[tuple[int, int]], failed: bool = False) -> None:
        # The copies are queued on this thread's current streams (the connector's copy stream):
        # an event marks where each write ends, and its page locks stay held until the device has
        # passed it, so the decode side cannot reuse a page a late copy may still write (page_locks).
        # Waiting for each write here instead (a synchronization per layer) cost ~1-2 ms per transfer
        # and held the copy thread. The locks are not counted per write (one lock file
        # description: a range is held or not), so they are all dropped together, once nothing
        # issued is still in flight; ``flush`` waits for the rest.
        with self._in_flight_lock:
            self._held.extend(held)
            for device in {self.src_pool.device, self.dst_pool.device}:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                self._events.append(event)
            self._release_landed(wait=failed)

    def _release_landed(self, wait: bool) -> None:
        """Drop every held page lock if every write issued has landed (``wait``: once it has)."""
        if wait:
            for event in self._events:
                event.synchronize()
        elif not all(event.query() for event in self._events):
            return
        self._events.clear()
        held, self._held = self._held, []
        self.locks.release(held)

    def flush(self, desc: TransferDescriptor) -> None:
        with self._in_flight_lock:
            self._release_landed(wait=True)  # every byte written is in the decode pool...
        super().flush(desc)  # ...and its pages still belong to this transfer

    def close(self) -> None:
        with self._in_flight_lock:
            self._release_landed(wait=True)
        super().close()
