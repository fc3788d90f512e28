"""A worker's memory moved into transparent huge pages once it is ready.

On a virtual machine whose guest page tables are shadowed (nested virtualization, e.g. the
project's 2-core Firecracker VMs, ``nested_pvm=1``), memory a process has not touched for a
while costs microseconds per 4 KiB page at its next touch, with no fault the guest counts:
reading 300 MiB took 30 ms warm, 41 ms after 0.5 s idle, 97 ms after 5 s and 329 ms after 20 s
(``bench/idle_memory.py``). An engine step reads every weight, so a prompt that comes after a
quiet spell paid it: a colocated stack's 240-token prompt, first token 95-110 ms warm and
362-378 ms after 10 s idle. In 2 MiB pages there are 512 times fewer entries to refill: 195-237 ms
after 10 s (docs/performance.md, "A quiet second costs tens of milliseconds here").

The weights, the KV pool and the step's buffers come from malloc (tcmalloc) in blocks mostly
under 2 MiB, so torch's own ``THP_MEM_ALLOC_ENABLE`` (allocations of 2 MiB or more) leaves most
of them in small pages. Instead, once the worker is ready, every private anonymous mapping is
advised ``MADV_HUGEPAGE`` (later faults in it get huge pages) and collapsed at once with
``MADV_COLLAPSE`` (Linux 6.1+; each 2 MiB copied into one huge page). That took ~2.7 s per GiB
here (SmolLM2's worker with its 1 GiB pool: 1.9 GiB in 5.2 s), and under steady load, where
every page is touched every step, it bought nothing measurable (``vllm bench serve`` at 1 and 2
req/s), so it is a worker's choice (``--huge-pages``), off by default.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
MADV_COLLAPSE = 25
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@dataclass(frozen=True)
class Settled:
    """What ``settle_in_huge_pages`` did."""

    advised_bytes: int  # mappings now marked MADV_HUGEPAGE
    collapsed_bytes: int  # of those, moved into huge pages at once
    seconds: float  # the calls' time
    skipped: str = ""  # why nothing was done, if so


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)  # (find_library runs ldconfig: once)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def madvise(start: int, length: int, advice: int) -> int:
    """``madvise(2)`` on ``[start, start + length)``: 0, or the errno it failed with."""
    return 0 if _libc().madvise(start, length, advice) == 0 else ctypes.get_errno()  # (the GIL let go meanwhile)


def anonymous_ranges(maps: str) -> list[tuple[int, int]]:
    """The 2 MiB-aligned ``[start, end)`` inside each private writable anonymous mapping (the
    heap included) of ``/proc/<pid>/maps`` text that holds at least one huge page."""
    ranges = []
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) < 5 or fields[1] != "rw-p":
            continue
        if len(fields) > 5 and fields[5] != "[heap]":  # files, stacks, vdso: not ours to move
            continue
        low, high = (int(x, 16) for x in fields[0].split("-"))
        start, end = -(-low // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES, high // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if end > start:
            ranges.append((start, end))
    return ranges


def anonymous_bytes(pid: int | str = "self") -> dict[str, int]:
    """Resident anonymous memory (``Anonymous``) and the part in huge pages (``AnonHugePages``)."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Anonymous", "AnonHugePages"):
                out[key] = int(value.split()[0]) << 10
    return out


def thp_setting() -> str:
    """The system's transparent huge page mode (always, madvise, never); '' where there is none."""
    try:
        with open(THP_SETTING) as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def settle_in_huge_pages() -> Settled:
    """Advise and collapse this process's anonymous memory into huge pages. A failure costs only
    the gain: a kernel without MADV_COLLAPSE leaves the advice to khugepaged's slow background pass."""
    if not sys.platform.startswith("linux") or thp_setting() in ("", "never"):
        return Settled(0, 0, 0.0, "no transparent huge pages on this system")
    with open("/proc/self/maps") as f:
        ranges = anonymous_ranges(f.read())
    started, advised, collapsed, errors = time.perf_counter(), 0, 0, set()
    for start, end in ranges:
        failed = madvise(start, end - start, MADV_HUGEPAGE)
        if failed:
            errors.add(failed)
            continue
        advised += end - start
        # EINVAL before Linux 6.1 or for a range it cannot take; EAGAIN/ENOMEM: no huge page free.
        failed = madvise(start, end - start, MADV_COLLAPSE)
        if failed:
            errors.add(failed)
        else:
            collapsed += end - start
    if errors:
        log.info("huge pages: some ranges not moved (errno %s)", sorted(errors))
    return Settled(advised, collapsed, time.perf_counter() - started)
