"""Decode-side leases and page fencing.

Every reservation gets a fresh epoch and a deadline; whoever drives the handoff renews the
deadline while the KV is still on its way (a long or queued prefill), so the deadline only
frees pages whose handoff nobody drives any more. The epoch is stamped on each reserved
page in a page-owner table; a writer may touch a page only while the page still carries its
epoch. Releasing, aborting or expiring a lease clears the stamps under the same lock that
in-process writers (tcp, nccl receivers) hold while they write, so no write of a stale
attempt lands after the release returns. Writers in another process (shm, cuda_ipc) check the
stamps in shared memory before each copy and hold page locks (``page_locks``) until it landed;
pages whose copy is still under way when their lease ends are set aside until it is not.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from splitserve.kvtransfer.base import LeaseExpiredError, StaleEpochError
from splitserve.kvtransfer.page_locks import PageLocks

FREE = -1


@dataclass
class Lease:
    request_id: str
    epoch: int
    deadline: float
    block_ids: tuple[int, ...]
    completed: bool = False


class PageFence:
    """Which epoch owns each page of a pool (FREE when none). Optionally backed by shared memory,
    with ``locks`` on the table's file that senders in other processes hold while they copy."""

    def __init__(self, owners: torch.Tensor, locks: PageLocks | None = None):
        if owners.dtype != torch.int64 or owners.dim() != 1:
            raise ValueError("page owners must be a 1-D int64 tensor")
        self.owners = owners
        self.owners.fill_(FREE)
        self.lock = threading.RLock()
        self.locks = locks

    def quiet(self, block_ids: Sequence[int]) -> bool:
        """No writer can still be copying into these (already unstamped) pages. In-process
        writers hold ``lock`` while they write, so a release under it is final; a sender in
        another process holds its page locks from its epoch check until its bytes landed."""
        return self.locks is None or self.locks.quiet(block_ids)

    def close(self) -> None:
        if self.locks is not None:
            self.locks.close()

    def stamp(self, block_ids: Sequence[int], epoch: int) -> None:
        self.owners[list(block_ids)] = epoch

    def owned_by(self, block_ids: Sequence[int], epoch: int) -> bool:
        return bool((self.owners[list(block_ids)] == epoch).all())


class LeaseTable:
    """Open handoffs of one decode worker. Thread-safe."""

    def __init__(self, fence: PageFence, ttl_s: float, clock: Callable[[], float] = time.time):
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl_s}")
        self.fence = fence
        self.ttl_s = ttl_s
        self.clock = clock
        # Epochs start at the wall clock in microseconds so a restarted worker never reissues one.
        self._epochs = itertools.count(int(time.time() * 1e6))
        self._leases: dict[str, Lease] = {}

    def grant(self, request_id: str, block_ids: Sequence[int]) -> Lease:
        with self.fence.lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already holds a lease")
            lease = Lease(request_id, next(self._epochs), self.clock() + self.ttl_s, tuple(block_ids))
            self._leases[request_id] = lease
            self.fence.stamp(lease.block_ids, lease.epoch)
            return lease

    def get(self, request_id: str) -> Lease | None:
        return self._leases.get(request_id)

    def check(self, request_id: str, epoch: int) -> Lease:
        """The live lease of ``request_id`` at ``epoch``, or a clear error."""
        lease = self._leases.get(request_id)
        if lease is None or lease.epoch != epoch:
            current = lease.epoch if lease else None
            raise StaleEpochError(f"request {request_id!r}: epoch {epoch} is stale (current: {current}); "
                                  "the reservation was released or re-issued")
        if self.clock() > lease.deadline:
            raise LeaseExpiredError(f"request {request_id!r}: lease expired {self.clock() - lease.deadline:.2f} s ago")
        return lease

    @contextlib.contextmanager
    def writing(self, request_id: str, epoch: int) -> Iterator[Lease]:
        """Hold the fence while writing pages of a live lease (in-process receivers)."""
        with self.fence.lock:
            yield self.check(request_id, epoch)

    def renew(self, request_id: str, epoch: int) -> Lease:
        """Push a live lease's deadline ``ttl_s`` from now: its KV is still on its way (the
        prefill is queued or running). A lease already expired, released or re-issued stays gone."""
        with self.fence.lock:
            lease = self.check(request_id, epoch)
            lease.deadline = self.clock() + self.ttl_s
            return lease

    def complete(self, request_id: str, epoch: int) -> Lease:
        with self.fence.lock:
            lease = self.check(request_id, epoch)
            lease.completed = True
            return lease

    def release(self, request_id: str) -> Lease | None:
        """End a lease (finished, aborted or expired): its pages stop accepting writes at once."""
        with self.fence.lock:
            lease = self._leases.pop(request_id, None)
            if lease is not None:
                self.fence.stamp(lease.block_ids, FREE)
            return lease

    def expired(self) -> list[str]:
        """Incomplete leases past their deadline (the prefill side died or stalled)."""
        now = self.clock()
        with self.fence.lock:
            return [rid for rid, lease in self._leases.items() if not lease.completed and now > lease.deadline]

    def __len__(self) -> int:
        return len(self._leases)
