"""Same host, GPUs: the decode pool is exported through a CUDA IPC handle and written by
device-to-device copies from the prefill process.

The decode side publishes, in a shared-memory directory (as the shm transport does), the
page-owner table and the pool's IPC handle, produced by torch's own CUDA tensor sharing
(`torch.multiprocessing.reductions`) and written as JSON (never pickle). The prefill side
opens the handle, checks page ownership before each layer like the shm sender, and issues
`copy_` between the two device pools; `flush` synchronises the stream so every copy has
landed before completion is reported. Across containers this needs shared IPC and PID
namespaces (compose: `ipc: host`, `pid: host` or a shared service namespace).
"""
from __future__ import annotations

import base64
from pathlib import Path

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from kvtransfer.base import TransferDescriptor
from kvtransfer.lease import LeaseTable
from kvtransfer.transports.shm import ShmReceiver, ShmSender, create_pool_directory


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
        return {"class": f"{value.__module__}.{value.__qualname__}"}
    return value


_CLASSES = {"torch.Tensor": torch.Tensor, "torch.storage.UntypedStorage": torch.UntypedStorage,
            "torch.UntypedStorage": torch.UntypedStorage}


def _decode(value):
    if isinstance(value, dict):
        if "b64" in value:
            return base64.b64decode(value["b64"])
        if "dtype" in value:
            return getattr(torch, value["dtype"])
        if "size" in value:
            return torch.Size(value["size"])
        if "tuple" in value:
            return tuple(_decode(v) for v in value["tuple"])
        if "class" in value:
            if value["class"] not in _CLASSES:
                raise ValueError(f"unexpected class in a CUDA IPC handle: {value['class']}")
            return _CLASSES[value["class"]]
    return value


def export_handle(pool: torch.Tensor) -> list:
    """The arguments that rebuild ``pool`` in another process, as JSON-safe values."""
    rebuild, args = reduce_tensor(pool)
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError("cuda_ipc needs a CUDA pool")
    return [_encode(a) for a in args]


class CudaIpcReceiver(ShmReceiver):
    name = "cuda_ipc"

    def __init__(self, pool: torch.Tensor, leases: LeaseTable, directory: Path):
        super().__init__(pool, leases, directory)

    @classmethod
    def create(cls, pool: torch.Tensor, lease_ttl_s: float, clock) -> "CudaIpcReceiver":
        from kvtransfer.lease import PageFence
        owners, directory = create_pool_directory(pool.shape, pool.dtype, {"ipc": export_handle(pool)})
        return cls(pool, LeaseTable(PageFence(owners), lease_ttl_s, clock=clock), directory)


class CudaIpcSender(ShmSender):
    name = "cuda_ipc"

    def _map_pool(self, directory: Path, meta: dict) -> torch.Tensor:
        return rebuild_cuda_tensor(*[_decode(a) for a in meta["ipc"]])

    def flush(self, desc: TransferDescriptor) -> None:
        torch.cuda.current_stream(self.src_pool.device).synchronize()
        super().flush(desc)
