"""kvtransfer on the other ranks of a tensor-parallel worker: rank r's slice goes to rank r's slice.

Every rank holds its own KV heads of every page, at the same page ids. Rank 0 keeps the whole
protocol (reserve, leases, descriptors, completion); ranks r > 0 only move bytes:

* decode: each rank opens its own receivers (shm: its pool's directory; tcp: its own port)
  and reports their addresses; the descriptor carries them (``rank_offers``). They are fenced by
  rank 0's page-owner table, which lives in shared memory, so a page released on rank 0 stops
  taking writes on every rank.
* prefill: rank 0 tells each step which pages go where (``CopyOrder``); rank r writes its slice
  of each layer as soon as the layer is computed, flushes at the end of the step and reports what
  failed, so rank 0 completes a transfer only when every rank's bytes landed.

Between tensor-parallel workers: shm and tcp (tested on CPU), cuda_ipc (GPU; not run here yet);
not nccl.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
import logging
import os
from pathlib import Path
from typing import Iterator, Sequence

import torch

from splitserve.engine.kv_connector import FollowerKVConnector
from splitserve.engine.tensor_parallel import messages
from splitserve.kvtransfer.base import TransferDescriptor
from splitserve.kvtransfer.head_map import HeadSlice, rank_descriptor, routes
from splitserve.kvtransfer.lease import Lease
from splitserve.kvtransfer.transports.base import KVReceiver, KVSender

log = logging.getLogger(__name__)

TP_TRANSPORTS = ("shm", "cuda_ipc", "tcp")


@messages.register
@dataclass(frozen=True)
class CopyOrder:
    """Ship this step's pages of one prefill transfer: rank r writes its own slice of ``runs`` of
    every layer into decode rank r's pages, over ``transport`` (the one rank 0 picked). The
    prefill connector's per-step orders (``KVConnector.step_orders``)."""

    desc: TransferDescriptor  # with the decode ranks' offers
    transport: str
    runs: tuple[tuple[int, int, int], ...]

    @classmethod
    def from_wire(cls, values: dict) -> "CopyOrder":
        return cls(values["desc"], values["transport"], tuple(tuple(run) for run in values["runs"]))


@messages.register
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
    # Send: the prefill worker's ranks, which with the decode worker's say which heads go where
    # (head_map.routes; the decode worker may be split otherwise).
    tensor_parallel_size: int = 0

    @classmethod
    def from_wire(cls, values: dict) -> "KVSetup":
        return cls(**{**values, "transports": tuple(values["transports"])})


messages.register(TransferDescriptor)


def tp_transports(names: Sequence[str], automatic: bool, tensor_parallel_size: int) -> list[str]:
    """The transports a tensor-parallel decode worker offers: the automatic choice less those
    ranks cannot use yet; a transport asked for by name that they cannot use is an error."""
    unsupported = [n for n in names if n not in TP_TRANSPORTS]
    if unsupported and not automatic:
        raise ValueError(f"KV transport(s) {', '.join(unsupported)} are not supported with tensor_parallel_size "
                         f"{tensor_parallel_size} yet; use {', '.join(TP_TRANSPORTS)}")
    return [n for n in names if n in TP_TRANSPORTS]


class FollowerPool:
    """A follower's pool factory: the pool in shared memory (CPU), so shm senders can map it."""

    def __init__(self):
        self.directory: Path | None = None

    def __call__(self, shape, dtype, device) -> torch.Tensor:
        if device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        from splitserve.kvtransfer.transports.shm import create_shared_pool
        pool, _, self.directory = create_shared_pool(shape, dtype)
        return pool

    def remove(self) -> None:
        if self.directory is not None:
            from splitserve.kvtransfer.transports.shm import remove_pool_directory
            remove_pool_directory(self.directory)


class _SharedFence:
    """Rank 0's page-owner table seen from another rank (read only here)."""

    def __init__(self, owners: torch.Tensor):
        self.owners = owners

    def owned_by(self, block_ids, epoch: int) -> bool:
        return bool((self.owners[list(block_ids)] == epoch).all())


class FollowerLeases:
    """What an in-process receiver asks of a lease table, answered from rank 0's shared page
    owners: a write lands only on pages stamped with its epoch. Lease deadlines and completion
    stay with rank 0, which checks them at its own flush before a transfer completes. Rank 0's
    fence lock is in another process: a write checked just before a release may still land in
    a page of this rank after it (the page's next owner writes it again before it is read)."""

    def __init__(self, owners: torch.Tensor):
        self.fence = _SharedFence(owners)

    def check(self, request_id: str, epoch: int) -> Lease | None:
        return None

    @contextlib.contextmanager
    def writing(self, request_id: str, epoch: int) -> Iterator[None]:
        yield None


def _link_owners(owners_path: Path, directory: Path) -> None:
    """Senders map <directory>/owners beside a pool: make it the same file as rank 0's table."""
    link = directory / "owners"
    link.unlink(missing_ok=True)
    os.link(owners_path, link)


class FollowerKV(FollowerKVConnector):
    """kvtransfer on a rank r > 0: its receivers (decode) or its senders (prefill), moving this
    rank's slice of every page as rank 0's orders say."""

    def __init__(self, rank: int, pool: torch.Tensor, directory: Path | None):
        self.rank = rank
        self.pool = pool
        self.directory = directory
        self.receivers: list[KVReceiver] = []
        self.factories: dict = {}
        self._senders: dict[tuple[str, str], KVSender] = {}
        self._errors: dict[str, str] = {}
        self.tensor_parallel_size = 0  # this worker's ranks (send: KVSetup says)

    def setup(self, setup: KVSetup) -> list[tuple[str, str]]:
        """Open receivers (``serve``; returns their offers, in ``setup.transports`` order) or get
        ready to send (``send``)."""
        if setup.role == "send":
            from splitserve.kvtransfer import sender_factories
            self.factories = sender_factories(self.pool, setup.transports, setup.kv_key)
            self.tensor_parallel_size = setup.tensor_parallel_size
            return []
        from splitserve.kvtransfer.transports.shm import _map
        owners_path = Path(setup.owners_path)
        leases = FollowerLeases(_map(owners_path, self.pool.shape[2], torch.int64))
        for name in setup.transports:
            if name == "shm":
                from splitserve.kvtransfer.transports.shm import ShmReceiver
                _link_owners(owners_path, self.directory)
                self.receivers.append(ShmReceiver(self.pool, leases, self.directory))
            elif name == "cuda_ipc":
                from splitserve.kvtransfer.transports.cuda_ipc import CudaIpcReceiver, export_handle
                from splitserve.kvtransfer.transports.shm import create_pool_directory
                _, directory = create_pool_directory(self.pool.shape, self.pool.dtype, {"ipc": export_handle(self.pool)})
                _link_owners(owners_path, directory)
                self.receivers.append(CudaIpcReceiver(self.pool, leases, directory))
            elif name == "tcp":
                from splitserve.kvtransfer.transports.tcp import TcpReceiver
                self.receivers.append(TcpReceiver(self.pool, leases, host=setup.host,
                                                  advertise_host=setup.advertise_host, key=setup.kv_key))
            else:
                raise ValueError(f"transport {name!r} is not supported between tensor-parallel ranks")
        return [(r.name, r.address) for r in self.receivers]

    def _targets(self, order: CopyOrder) -> list[tuple[KVSender, TransferDescriptor, HeadSlice | None]]:
        """This rank's destinations for ``order``: decode rank r's pages whole when both workers
        are split alike, else the slices of the decode ranks its heads go to (head_map)."""
        layout = order.desc.layout
        mine = self.tensor_parallel_size or layout.tensor_parallel_size
        out = []
        for route in routes(layout.total_kv_heads, mine, self.rank, layout.tensor_parallel_size):
            desc = rank_descriptor(order.desc, route.dst_rank, order.transport)
            key = (desc.transport, desc.address)
            if key in self._senders and not self._senders[key].usable():  # broken, or its pool is gone
                with contextlib.suppress(Exception):
                    self._senders.pop(key).close()
            if key not in self._senders:
                self._senders[key] = self.factories[desc.transport](desc.address)
            out.append((self._senders[key], desc, route.heads))
        return out

    def save_layer(self, orders: Sequence[CopyOrder], layer: int) -> None:
        def write(sender, desc, heads, order):
            if heads is None:
                sender.write(desc, layer, order.runs)
            else:
                sender.write(desc, layer, order.runs, heads)
        self._each(orders, write)

    def finish_step(self, orders: Sequence[CopyOrder]) -> dict[str, str]:
        """Flush this step's transfers; returns {request id: why it failed} and forgets them."""
        self._each(orders, lambda sender, desc, heads, order: sender.flush(desc))
        errors, self._errors = self._errors, {}
        return errors

    def _each(self, orders: Sequence[CopyOrder], action) -> None:
        """``action`` for every transfer not failed yet; a failure is kept for rank 0, which fails
        the transfer (this rank goes on with the others)."""
        for order in orders:
            rid = order.desc.request_id
            if rid in self._errors:
                continue
            try:
                for sender, desc, heads in self._targets(order):
                    action(sender, desc, heads, order)
            except Exception as e:
                self._errors[rid] = f"tensor-parallel rank {self.rank}: {e}"

    def close(self) -> None:
        for sender in self._senders.values():
            with contextlib.suppress(Exception):
                sender.close()
        for receiver in self.receivers:
            if receiver.name != "shm":  # the shm directory is the pool's, removed with it
                with contextlib.suppress(Exception):
                    receiver.close()
