"""tcmalloc under the engine processes, where it is installed.

A step allocates and frees the same few hundred kilobyte-to-megabyte activation tensors again
and again; glibc's malloc hands large blocks back to the kernel and faults them in anew, tcmalloc
keeps them. Measured on this project's 2-core AVX2 VM (``python -m bench.engine_throughput
--systems splitserve --workload mixed --num-requests 64``, one process per round, rounds
alternated): 104.6 / 106.1 / 112.7 output tok/s with glibc against 114.2 / 117.3 / 114.7 with
tcmalloc preloaded, about +8 %. vLLM-CPU's documentation asks for the same preload, and the
side-by-side benchmarks give it to vLLM too. Pinning the OpenMP threads to cores on top of it
(OMP_PROC_BIND) measured no better (109.5 vs 110.9); Intel's OpenMP in place of torch's GNU one,
worse (97.6).

A process cannot swap its allocator once it runs, so the worker commands (and the engine
benchmarks) start themselves again with ``LD_PRELOAD`` naming tcmalloc, before torch is imported;
their children (a tensor-parallel worker's ranks) inherit it. ``SPLITSERVE_ALLOCATOR=system``
keeps glibc's malloc; without tcmalloc installed (Debian/Ubuntu: ``libtcmalloc-minimal4``, which
``make install`` and the container image install) nothing changes.
"""
from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

ALLOCATOR_ENV = "SPLITSERVE_ALLOCATOR"  # "tcmalloc" (the default, when installed) or "system"
LARGE_ALLOC_REPORT_ENV = "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"
_LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                 "/usr/local/lib")
_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")


def tcmalloc_library() -> str | None:
    """The path (or, found by the linker cache only, the name) of an installed tcmalloc, or None."""
    for directory in _LIBRARY_DIRS:
        for name in _NAMES:
            if (Path(directory) / name).exists():
                return str(Path(directory) / name)
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def env_with_tcmalloc(env: dict[str, str], library: str | None) -> dict[str, str] | None:
    """``env`` with ``library`` added to LD_PRELOAD; None when nothing is to change (no library,
    the user chose the system allocator, or a tcmalloc is preloaded already)."""
    if library is None or env.get(ALLOCATOR_ENV, "tcmalloc") == "system":
        return None
    preload = env.get("LD_PRELOAD", "")
    if "tcmalloc" in preload:
        return None
    # tcmalloc reports every allocation over 1 GiB on stderr (a KV pool is one); not news here.
    return {LARGE_ALLOC_REPORT_ENV: str(1 << 40), **env,
            "LD_PRELOAD": f"{library}:{preload}" if preload else library}


def preloaded() -> bool:
    """tcmalloc is mapped into this process."""
    try:
        return "tcmalloc" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def restart_with_tcmalloc() -> None:
    """Replace this process with itself under tcmalloc (same pid, argv and environment otherwise);
    returns only when there is nothing to do."""
    env = env_with_tcmalloc(dict(os.environ), tcmalloc_library())
    if env is None or preloaded():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
