"""Big request buffers go back to the operating system once freed (glibc only).

glibc serves an allocation of at least its mmap threshold (128 KiB) from a mapping of its own,
returned to the system when freed; but each time such a block is freed it raises the threshold
to that block's size (up to 32 MiB), after which blocks that size come from the heap and stay
there when freed. A gateway that received a burst of 12 MB requests (refused by their size)
kept hundreds of MiB that way, and a second burst added more. Setting the threshold once turns
that adjustment off: every buffer of 1 MiB or more -- a large message, its parsed copy, its text
-- keeps its own mapping and leaves with it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20


def return_big_buffers() -> bool:
    """Fix glibc's mmap threshold at ``MMAP_THRESHOLD_BYTES``; False where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        ok = libc is not None and hasattr(libc, "mallopt") and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    except OSError:
        ok = False
    if not ok:
        log.info("mallopt unavailable: large freed buffers may stay in the heap")
    return ok
