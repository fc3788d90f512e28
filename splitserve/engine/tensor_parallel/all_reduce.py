"""The all-reduce of a row-parallel layer: shared memory between ranks on one CPU host, else the
process group (NCCL on GPUs, gloo elsewhere).

gloo over loopback took 1.0-2.7 ms per all-reduce of a decode step's [1-1,024, 512] fp32 rows
here (2 processes, 1 thread each), and a step has two per layer: 60 for a 30-layer model, more
than the step's compute. On one host the ranks instead share a file under /dev/shm, as vLLM-CPU's
shared-memory communicator does: each rank copies its partial sum into its own slot, publishes the
call's number in a flag, waits (spinning, then yielding) until every rank has published, and adds
the slots up in rank order, so every rank holds the same bits. Two slots per rank alternate
between calls: a rank can only reuse a slot after every rank has published the call after it,
i.e. finished reading it. Tensors larger than a slot go through the process group.

A rank that dies must not leave the others spinning: rank 0 raises an abort flag when it sees a
rank exit, the others give up when their parent (rank 0) is gone, and every wait ends after
``TIMEOUT_S`` in any case.
"""
from __future__ import annotations

import mmap
import os
import time
import uuid
from pathlib import Path

import numpy as np
import torch

HEADER_BYTES = 4096  # the flags, one page
TIMEOUT_S = 600.0
_SPINS_BEFORE_YIELD = 256
_SPINS_PER_CHECK = 4096


class ProcessGroupAllReduce:
    def __init__(self, group):
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()  # functional for the compiler: the input is not reduced in place
        self.group.allreduce([out]).wait()
        return out

    def abort(self) -> None:
        pass


def create_shm_file(world: int, slot_bytes: int) -> Path:
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    path = root / f"splitserve-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(path, "wb") as f:
        f.truncate(HEADER_BYTES + world * 2 * slot_bytes)
    return path


class ShmAllReduce(ProcessGroupAllReduce):
    def __init__(self, group, path: Path, rank: int, world: int, slot_bytes: int):
        super().__init__(group)
        self.rank, self.world, self.slot_bytes = rank, world, slot_bytes
        with open(path, "r+b") as f:
            self._mmap = mmap.mmap(f.fileno(), HEADER_BYTES + world * 2 * slot_bytes)
        # flags[r]: the last call rank r published; flags[world]: non-zero once a rank died.
        self.flags = np.ndarray((world + 1,), dtype=np.int64, buffer=self._mmap)
        self.slots = torch.frombuffer(self._mmap, dtype=torch.uint8, offset=HEADER_BYTES,
                                      count=world * 2 * slot_bytes).view(world, 2, slot_bytes)
        self.calls = 0
        self._parent = os.getppid()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        if nbytes > self.slot_bytes or x.device.type != "cpu":  # the same choice on every rank: same shapes
            return super().__call__(x)
        self.calls += 1
        call, half = self.calls, self.calls % 2
        views = [self.slots[r, half, :nbytes].view(x.dtype).view(x.shape) for r in range(self.world)]
        views[self.rank].copy_(x)
        self.flags[self.rank] = call  # after the copy: x86 keeps stores in order for the other cores
        self._wait(call)
        out = views[0] + views[1]
        for view in views[2:]:
            out += view
        return out

    def _wait(self, call: int) -> None:
        flags, others = self.flags, [r for r in range(self.world) if r != self.rank]
        spins, start = 0, None
        while any(flags[r] < call for r in others):
            spins += 1
            if spins > _SPINS_BEFORE_YIELD:
                os.sched_yield()  # a rank sharing its core with the one it waits for lets it run
            if spins % _SPINS_PER_CHECK == 0:
                start = start or time.monotonic()
                self._check(start)

    def _check(self, start: float) -> None:
        if self.flags[self.world]:
            raise RuntimeError("tensor-parallel all-reduce aborted: a rank of this worker died")
        if self.rank and os.getppid() != self._parent:
            raise RuntimeError("tensor-parallel all-reduce aborted: rank 0 is gone")
        if time.monotonic() - start > TIMEOUT_S:
            raise RuntimeError(f"tensor-parallel all-reduce: a rank did not answer in {TIMEOUT_S:.0f} s")

    def abort(self) -> None:
        """Wake every rank waiting in an all-reduce with an error (a rank died)."""
        self.flags[self.world] = 1
