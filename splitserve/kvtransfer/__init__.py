"""Moving paged KV from a prefill pool into pages reserved in a decode pool.

``build_decode`` and ``build_prefill`` wire an engine to a transport; the connectors in
``decode_side`` / ``prefill_side`` hold the protocol (reserve, write layer by layer, flush,
complete with the epoch).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

from splitserve.kvtransfer.base import (ChecksumMismatchError, KVLayout, LayoutMismatchError, LeaseExpiredError,
                             StaleEpochError, TransferAbortedError, TransferDescriptor, TransferError,
                             TransportUnavailableError)

log = logging.getLogger(__name__)

TRANSPORTS = ("shm", "tcp", "nccl", "cuda_ipc")

__all__ = ["build_decode", "build_prefill", "TRANSPORTS", "TransferDescriptor", "KVLayout", "TransferError",
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


def build_decode(config, transport: str = "auto", lease_ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.time, host: str = "127.0.0.1", advertise_host: str | None = None,
                 kv_key: bytes | None = None):
    """A decode engine whose pool accepts KV over ``transport``; returns its DecodeConnector.

    Network receivers listen on ``host`` and tell prefill workers to dial ``advertise_host``;
    with ``kv_key`` (``Security.kv_key``) the tcp receiver takes pages only from senders with it."""
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.engine.model_runner import default_pool, resolve_device
    from splitserve.kvtransfer.decode_side import DecodeConnector
    from splitserve.kvtransfer.lease import LeaseTable, PageFence

    names = choose_transports(transport, resolve_device(config.device).type)
    tp = config.tensor_parallel_size
    if tp > 1:
        from splitserve.kvtransfer.tensor_parallel import tp_transports
        names = tp_transports(names, transport == "auto", tp)
    shared: dict = {}
    if "shm" in names:
        from splitserve.kvtransfer.transports.shm import create_shared_pool

        def pool_factory(shape, dtype, device):
            pool, owners, directory = create_shared_pool(shape, dtype)
            shared.update(owners=owners, directory=directory)
            return pool
    else:
        pool_factory = default_pool
    engine = LLMEngine(config, pool_factory=pool_factory)
    pool = engine.runner.kv_cache
    receivers = []
    cleanup = []
    if "cuda_ipc" in names:
        from splitserve.kvtransfer.transports.cuda_ipc import CudaIpcReceiver
        # Its page-owner table lives in shared memory, so every receiver fences on it.
        receivers.append(CudaIpcReceiver.create(pool, lease_ttl_s, clock))
        leases = receivers[0].leases
        shared["directory"] = receivers[0].directory
    else:
        if "owners" not in shared and tp > 1:  # the other ranks' receivers fence on it: shared memory
            from splitserve.kvtransfer.transports.shm import create_pool_directory, remove_pool_directory
            pages = engine.runner.kv_pages
            shared["owners"], shared["directory"] = create_pool_directory(pages.shape, pages.dtype)
            cleanup.append(lambda: remove_pool_directory(Path(shared["directory"])))
        owners = shared.get("owners", torch.empty(pool.shape[2], dtype=torch.int64))
        leases = LeaseTable(PageFence(owners), lease_ttl_s, clock=clock)
    for name in names:
        if name == "shm":
            from splitserve.kvtransfer.transports.shm import ShmReceiver
            receivers.append(ShmReceiver(pool, leases, Path(shared["directory"])))
        elif name == "tcp":
            from splitserve.kvtransfer.transports.tcp import TcpReceiver
            receivers.append(TcpReceiver(pool, leases, host=host, advertise_host=advertise_host, key=kv_key))
        elif name == "nccl":
            from splitserve.kvtransfer.transports.nccl import NcclReceiver
            receivers.append(NcclReceiver(pool, leases, host=host, advertise_host=advertise_host))
    receivers.sort(key=lambda r: names.index(r.name))
    log.info("decode KV transports (fastest first): %s", ", ".join(f"{r.name}@{r.address}" for r in receivers))
    rank_offers = ()
    if engine.runner.followers is not None:
        from splitserve.engine.tensor_parallel.messages import KVSetup
        rank_offers = tuple(tuple((t, a) for t, a in offers) for offers in engine.runner.followers.request(KVSetup(
            "serve", tuple(r.name for r in receivers), str(Path(shared["directory"]) / "owners"), host=host,
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
                from splitserve.kvtransfer.transports.tcp import TcpSender
                return TcpSender(address, pool, key=kv_key)
            from splitserve.kvtransfer.transports.nccl import NcclSender
            return NcclSender(address, pool)
        return factory
    return {name: make(name) for name in transports}


def build_prefill(config, transports: Iterable[str] = TRANSPORTS, verify_checksum: bool = False,
                  kv_key: bytes | None = None):
    """A prefill engine that ships KV over any of ``transports``; returns its PrefillConnector.
    ``kv_key``: the secret the tcp sender proves to decode workers (``Security.kv_key``)."""
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.kvtransfer.prefill_side import PrefillConnector

    engine = LLMEngine(config)
    transports = tuple(transports)
    if engine.runner.followers is not None:
        from splitserve.engine.tensor_parallel.messages import KVSetup
        from splitserve.kvtransfer.tensor_parallel import TP_TRANSPORTS
        # Tensor-parallel ranks send over shm, cuda_ipc and tcp (not nccl): only those are used here.
        transports = tuple(t for t in transports if t in TP_TRANSPORTS)
        engine.runner.followers.request(KVSetup("send", transports, kv_key=kv_key))
    return PrefillConnector(engine, sender_factories(engine.runner.kv_cache, transports, kv_key), verify_checksum)
