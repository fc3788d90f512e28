"""Moving paged KV from a prefill pool into pages reserved in a decode pool.

The engine is met through its written contract (``splitserve.engine.kv_connector``): the
connectors in ``decode_side`` / ``prefill_side`` hold the protocol (reserve, write layer by
layer, flush, complete with the epoch); ``open_decode`` and ``open_prefill`` put them on an
engine that a worker built (``splitserve.worker.wiring``), ``DecodePool`` places a decode
engine's pool where its transports need it.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from splitserve.engine.kv_connector import KVHandoffEngine

from splitserve.kvtransfer.base import (ChecksumMismatchError, KVLayout, LayoutMismatchError, LeaseExpiredError,
                             StaleEpochError, TransferAbortedError, TransferDescriptor, TransferError,
                             TransportUnavailableError)

log = logging.getLogger(__name__)

TRANSPORTS = ("shm", "tcp", "nccl", "cuda_ipc")

__all__ = ["open_decode", "open_prefill", "DecodePool", "choose_transports", "sender_factories", "TRANSPORTS", "TransferDescriptor", "KVLayout", "TransferError",
           "LayoutMismatchError", "StaleEpochError", "LeaseExpiredError", "TransferAbortedError",
           "ChecksumMismatchError", "TransportUnavailableError"]


def choose_transports(requested: str, device_type: str) -> list[str]:
    """Transports a decode worker offers, fastest first.

    ``auto``: same-host zero-copy first (cuda_ipc for GPU pools, shm for CPU pools), then a
    transport that crosses hosts (nccl between GPUs, tcp otherwise). A comma list is taken as given.
    """
    if requested == "auto":
        return ["cuda_ipc", "nccl", "tcp"] if device_type == "cuda" else ["shm", "tcp"]
    names = [n.strip() for n in requested.split(",") if n.strip()]
    for name in names:
        if name not in TRANSPORTS:
            raise ValueError(f"kv transport must be 'auto' or a comma list of {TRANSPORTS}, got {name!r}")
    if not names:
        raise ValueError("kv transport list is empty")
    return names


class DecodePool:
    """A decode engine's pool factory for ``transports``: the pool in shared memory when shm
    senders must map it (``pool_factory`` of ``LLMEngine``); it notes what it made."""

    def __init__(self, transports: Sequence[str]):
        self.transports = list(transports)
        self.owners: torch.Tensor | None = None  # the shm page-owner table beside a shared pool
        self.directory: Path | None = None
        self.shape: tuple[int, ...] = ()
        self.dtype: torch.dtype | None = None

    def __call__(self, shape, dtype, device) -> torch.Tensor:
        self.shape, self.dtype = tuple(shape), dtype
        if "shm" not in self.transports:
            return torch.zeros(shape, dtype=dtype, device=device)
        from splitserve.kvtransfer.transports.shm import create_shared_pool
        pool, self.owners, self.directory = create_shared_pool(shape, dtype)
        return pool


def open_decode(engine: KVHandoffEngine, pool: DecodePool, lease_ttl_s: float = 30.0,
                clock: Callable[[], float] = time.time, host: str = "127.0.0.1", advertise_host: str | None = None,
                kv_key: bytes | None = None):
    """The receivers of ``pool.transports`` on an engine built on ``pool``; returns its DecodeConnector.

    Network receivers listen on ``host`` and tell prefill workers to dial ``advertise_host``;
    with ``kv_key`` (``Security.kv_key``) the tcp receiver takes pages only from senders with it."""
    from splitserve.kvtransfer.decode_side import DecodeConnector
    from splitserve.kvtransfer.lease import LeaseTable, PageFence
    from splitserve.kvtransfer.page_locks import PageLocks

    names = pool.transports
    tp = engine.tensor_parallel_size
    cache = engine.kv_cache
    directory = pool.directory
    receivers = []
    cleanup = []
    if "cuda_ipc" in names:
        from splitserve.kvtransfer.transports.cuda_ipc import CudaIpcReceiver
        # Its page-owner table lives in shared memory, so every receiver fences on it.
        receivers.append(CudaIpcReceiver.create(cache, lease_ttl_s, clock))
        leases = receivers[0].leases
        directory = receivers[0].directory
    else:
        owners = pool.owners
        if owners is None and tp > 1:  # the other ranks' receivers fence on it: shared memory
            from splitserve.kvtransfer.transports.shm import create_pool_directory, remove_pool_directory
            owners, directory = create_pool_directory(pool.shape, pool.dtype)
            cleanup.append(lambda: remove_pool_directory(Path(directory)))
        if owners is None:
            owners = torch.empty(cache.shape[2], dtype=torch.int64)
        # With the table in shared memory, senders in other processes lock its pages while they copy.
        locks = PageLocks(Path(directory) / "owners") if directory is not None else None
        leases = LeaseTable(PageFence(owners, locks), lease_ttl_s, clock=clock)
    for name in names:
        if name == "shm":
            from splitserve.kvtransfer.transports.shm import ShmReceiver
            receivers.append(ShmReceiver(cache, leases, Path(directory)))
        elif name == "tcp":
            from splitserve.kvtransfer.transports.tcp import TcpReceiver
            receivers.append(TcpReceiver(cache, leases, host=host, advertise_host=advertise_host, key=kv_key))
        elif name == "nccl":
            from splitserve.kvtransfer.transports.nccl import NcclReceiver
            receivers.append(NcclReceiver(cache, leases, host=host, advertise_host=advertise_host, key=kv_key))
    receivers.sort(key=lambda r: names.index(r.name))
    log.info("decode KV transports (fastest first): %s", ", ".join(f"{r.name}@{r.address}" for r in receivers))
    rank_offers = ()
    if tp > 1:
        from splitserve.kvtransfer.tensor_parallel import KVSetup
        rank_offers = tuple(tuple((t, a) for t, a in offers) for offers in engine.configure_follower_kv(KVSetup(
            "serve", tuple(r.name for r in receivers), str(Path(directory) / "owners"), host=host,
            advertise_host=advertise_host, kv_key=kv_key)))
    return DecodeConnector(engine, receivers, leases, rank_offers, cleanup)


def sender_factories(pool: torch.Tensor, transports: Iterable[str], kv_key: bytes | None = None) -> dict:
    def make(name: str):
        def factory(address: str):
            if name == "shm":
                from splitserve.kvtransfer.transports.shm import ShmSender
                return ShmSender(address, pool)
            if name == "cuda_ipc":
                from splitserve.kvtransfer.transports.cuda_ipc import CudaIpcSender
                return CudaIpcSender(address, pool)
            if name == "tcp":
                from splitserve.kvtransfer.transports.tcp_sender import TcpSender
                return TcpSender(address, pool, key=kv_key)
            from splitserve.kvtransfer.transports.nccl import NcclSender
            return NcclSender(address, pool, key=kv_key)
        return factory
    return {name: make(name) for name in transports}


def open_prefill(engine: KVHandoffEngine, transports: Iterable[str] = TRANSPORTS, verify_checksum: bool = False,
                 kv_key: bytes | None = None):
    """Ship a prefill engine's KV over any of ``transports``; returns its PrefillConnector.
    ``kv_key``: the secret the tcp sender proves to decode workers (``Security.kv_key``)."""
    from splitserve.kvtransfer.prefill_side import PrefillConnector

    transports = tuple(transports)
    if engine.tensor_parallel_size > 1:
        from splitserve.kvtransfer.tensor_parallel import TP_TRANSPORTS, KVSetup
        # Tensor-parallel ranks send over shm, cuda_ipc and tcp (not nccl): only those are used here.
        transports = tuple(t for t in transports if t in TP_TRANSPORTS)
        engine.configure_follower_kv(KVSetup("send", transports, kv_key=kv_key,
                                             tensor_parallel_size=engine.tensor_parallel_size))
    return PrefillConnector(engine, sender_factories(engine.kv_cache, transports, kv_key), verify_checksum)
