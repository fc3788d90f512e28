"""A worker's memory moved into transparent huge pages once it is ready.

On a virtual machine whose guest page tables are shadowed (nested virtualization, e.g. the
project's 2-core Firecracker VMs, ``nested_pvm=1``), memory a process has not touched for a
while costs microseconds per 4 KiB page at its next touch, with no fault the guest counts:
reading 300 MiB took 30 ms warm, 41 ms after 0.5 s idle, 97 ms after 5 s and 329 ms after 20 s
(``bench/idle_memory.py``). An engine step reads every weight, so a prompt that comes after a
quiet spell paid it: a colocated stack's 240-token prompt, first token 95-110 ms warm and
362-378 ms after 10 s idle. In 2 MiB pages there are 512 times fewer entries to refill: 195-237 ms
after 10 s (in a later pair of runs 151-171 ms without, 100-130 with; docs/performance.md, "A
quiet second costs tens of milliseconds here").

A small model's weights come from malloc (tcmalloc) in blocks under 2 MiB (SmolLM2's linears),
so torch's own ``THP_MEM_ALLOC_ENABLE`` (allocations of 2 MiB or more) leaves them in small
pages. Instead, once the worker is ready, the well-filled parts of every private anonymous
mapping (weights, a colocated worker's KV pool, the step's buffers; not a disaggregated decode
worker's pool in shared memory) are collapsed into huge pages with ``MADV_COLLAPSE`` (Linux 6.1+;
each 2 MiB copied into one huge page). Only the engine's first rank does it (tensor-parallel
followers keep small pages). That took ~2.7 s per GiB here (SmolLM2's worker with its 1 GiB
pool: 1.9 GiB in 5.0 s), and under steady load, where every page is touched every step, it
bought nothing measurable (``vllm bench serve`` at 1 and 2 req/s), so it is a worker's choice
(``--huge-pages``), off by default.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import sys
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
PAGE_BYTES = 4096
# A 2 MiB block is collapsed only where at least this many of its 512 small pages are resident:
# MADV_COLLAPSE fills the rest, so sparse memory (thread stacks, allocator reserves) would grow.
MIN_RESIDENT_PAGES = 256
MADV_HUGEPAGE = 14  # linux/mman.h
MADV_NOHUGEPAGE = 15
MADV_COLLAPSE = 25
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@dataclass(frozen=True)
class Settled:
    """What ``settle_in_huge_pages`` did, by the kernel's own counts (``anonymous_bytes``)."""

    huge_before: int  # bytes of anonymous memory in huge pages before
    huge_after: int  # and after
    anonymous_before: int  # resident anonymous memory before (the collapse fills what it takes)
    anonymous_after: int  # and after
    seconds: float  # the calls' time
    skipped: str = ""  # why nothing was done, if so


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)  # (find_library runs ldconfig: once)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def madvise(start: int, length: int, advice: int) -> int:
    """``madvise(2)`` on ``[start, start + length)``: 0, or the errno it failed with."""
    return 0 if _libc().madvise(start, length, advice) == 0 else ctypes.get_errno()  # (the GIL let go meanwhile)


def anonymous_ranges(maps: str) -> list[tuple[int, int]]:
    """The 2 MiB-aligned ``[start, end)`` inside each private writable anonymous mapping (the
    heap included) of ``/proc/<pid>/maps`` text that holds at least one huge page. Thread stacks
    are among them (unnamed); ``filled_runs`` leaves their untouched blocks alone."""
    ranges = []
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) < 5 or fields[1] != "rw-p":
            continue
        if len(fields) > 5 and fields[5] != "[heap]":  # files, the main stack, vdso: not ours to move
            continue
        low, high = (int(x, 16) for x in fields[0].split("-"))
        start, end = -(-low // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES, high // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if end > start:
            ranges.append((start, end))
    return ranges


_LOW_BIT = bytes(i & 1 for i in range(256))


def filled_runs(start: int, resident: bytes) -> list[tuple[int, int]]:
    """Runs of consecutive 2 MiB blocks from ``start`` with ``MIN_RESIDENT_PAGES`` or more resident
    small pages each, given ``mincore``'s byte per small page (bit 0: resident)."""
    per_block = HUGE_PAGE_BYTES // PAGE_BYTES
    resident = resident.translate(_LOW_BIT)  # the other bits are reserved
    runs: list[tuple[int, int]] = []
    for i in range(0, len(resident) // per_block):
        if resident.count(1, i * per_block, (i + 1) * per_block) < MIN_RESIDENT_PAGES:
            continue
        low = start + i * HUGE_PAGE_BYTES
        if runs and runs[-1][1] == low:
            runs[-1] = (runs[-1][0], low + HUGE_PAGE_BYTES)
        else:
            runs.append((low, low + HUGE_PAGE_BYTES))
    return runs


def resident_pages(start: int, end: int) -> bytes | None:
    """``mincore`` over ``[start, end)``: a byte per small page; None if it failed."""
    vector = (ctypes.c_ubyte * ((end - start) // PAGE_BYTES))()
    return bytes(vector) if _libc().mincore(start, end - start, vector) == 0 else None


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


def thp_available() -> bool:
    """Whether this system has transparent huge pages at all (Linux, THP not ``never``)."""
    return sys.platform.startswith("linux") and thp_setting() not in ("", "never")


def collapse_supported() -> bool:
    """Whether this kernel collapses memory on request (Linux 6.1+, THP not ``never``): tried on
    one filled huge page of a mapping of its own."""
    if not thp_available():
        return False
    area = mmap.mmap(-1, 2 * HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(area))  # (the view is gone by the close)
        start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        area[start - address:start - address + HUGE_PAGE_BYTES] = b"\x01" * HUGE_PAGE_BYTES
        return madvise(start, HUGE_PAGE_BYTES, MADV_COLLAPSE) == 0
    finally:
        area.close()


def settle_in_huge_pages() -> Settled:
    """Collapse this process's well-filled anonymous memory into huge pages (``filled_runs``). No
    lasting advice is left on the mappings: later faults stay in small pages, so no allocation
    waits on the kernel compacting memory for a huge one. Refused ranges are logged by errno
    (EINVAL everywhere: a kernel before 6.1)."""
    if not thp_available():
        return Settled(0, 0, 0, 0, 0.0, "no transparent huge pages on this system")
    before, started, errors = anonymous_bytes(), time.perf_counter(), set()
    with open("/proc/self/maps") as f:
        ranges = anonymous_ranges(f.read())
    for start, end in ranges:
        resident = resident_pages(start, end)
        if resident is None:  # unmapped meanwhile (another thread's free)
            continue
        for low, high in filled_runs(start, resident):
            failed = madvise(low, high - low, MADV_COLLAPSE)
            if failed:  # EAGAIN/ENOMEM: no huge page free; the rest of the run may still be moved
                errors.add(failed)
    after = anonymous_bytes()
    if errors:
        log.info("huge pages: some ranges not moved (errno %s)", sorted(errors))
    return Settled(before.get("AnonHugePages", 0), after.get("AnonHugePages", 0), before.get("Anonymous", 0),
                   after.get("Anonymous", 0), time.perf_counter() - started)
