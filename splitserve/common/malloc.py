"""glibc's allocator, asked to give memory back: shared by the processes that free a lot at once
(a gateway after refusing huge requests, a worker after quantizing its weights at load)."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def libc():
    """The C library, where ctypes finds one (None elsewhere)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def return_free_pages() -> bool:
    """Hand the free pages of every malloc arena back to the system (glibc's ``malloc_trim``: glibc
    otherwise keeps freed memory for reuse, returning only what lies at an arena's top); False
    where there is no glibc."""
    c = libc()
    if c is None or not hasattr(c, "malloc_trim"):
        return False
    c.malloc_trim(0)
    return True
