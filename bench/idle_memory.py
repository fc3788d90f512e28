"""How long reading memory takes after the process has left it alone for a while.

On the project's 2-core VMs (Firecracker, ``nested_pvm=1`` on the kernel command line: the guest's
page tables are shadowed) memory that a process has not touched for half a second already reads
slower, and after seconds each 4 KiB page costs microseconds to touch again, with no page fault
the guest counts. A server's first prompt after a pause pays that for every page its
step reads (docs/performance.md, "A quiet second costs tens of milliseconds here").

For each idle time, the buffer is read once (warm), left alone that long, and read again; the
same with the buffer in 2 MiB pages (``madvise(MADV_HUGEPAGE)`` before it is first touched), where
the system allows them. One thread, medians of ``--rounds``.

    python -m bench.idle_memory --mib 300 --idle 0.5,2,5,20 --out bench/results/idle_memory.json
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

import torch

from bench.common import write_json
from splitserve.common.huge_pages import HUGE_PAGE_BYTES, MADV_HUGEPAGE, MADV_NOHUGEPAGE, madvise, thp_available


def buffer(mib: int, huge: bool) -> torch.Tensor:
    """``mib`` MiB of float32 in an anonymous mapping of its own, advised into 2 MiB pages if
    ``huge``, else into 4 KiB ones (before the first touch, so the faults take them), then filled."""
    size = mib << 20
    area = mmap.mmap(-1, size + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = torch.frombuffer(area, dtype=torch.uint8)
    start = -view.data_ptr() % HUGE_PAGE_BYTES  # a huge page boundary
    # Small pages forced too: where THP is "always" the kernel would give huge ones unasked.
    failed = madvise(view.data_ptr() + start, size, MADV_HUGEPAGE if huge else MADV_NOHUGEPAGE)
    if failed:
        raise OSError(failed, os.strerror(failed))
    tensor = view[start:start + size].view(torch.float32)
    tensor.fill_(1.0)
    tensor._area = area  # the mapping lives as long as the tensor
    return tensor


def read_ms(tensor: torch.Tensor) -> float:
    start = time.perf_counter()
    tensor.sum().item()
    return 1000 * (time.perf_counter() - start)


def measure(tensor: torch.Tensor, idles: list[float], rounds: int) -> dict:
    """Median ms of one read of ``tensor``: right after another read, and after each idle time."""
    warm, after = [], {idle: [] for idle in idles}
    for _ in range(rounds):
        for idle in idles:
            read_ms(tensor)
            warm.append(read_ms(tensor))
            time.sleep(idle)
            after[idle].append(read_ms(tensor))
    return {"warm_ms": round(statistics.median(warm), 2),
            "after_idle_ms": {str(idle): round(statistics.median(ms), 2) for idle, ms in after.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=300, help="buffer size (SmolLM2-135M's bf16 weights: ~270)")
    parser.add_argument("--idle", default="0.5,2,5,20", help="idle times, seconds, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench/results/idle_memory.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    idles = [float(x) for x in args.idle.split(",")]
    results = {}
    for pages in ["4k", "2m"] if thp_available() else ["4k"]:
        results[pages] = measure(buffer(args.mib, huge=pages == "2m"), idles, args.rounds)
        print(pages, results[pages], flush=True)
    write_json(args.out, {"mib": args.mib, "rounds": args.rounds, "pages": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
