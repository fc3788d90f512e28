"""Big request buffers go back to the operating system once freed.

glibc serves an allocation of at least its mmap threshold (128 KiB) from a mapping of its own,
returned to the system when freed; but each time such a block is freed it raises the threshold
to that block's size (up to 32 MiB), after which blocks that size come from the heap and stay
there when freed. A gateway that received a burst of 12 MB requests (refused by their size)
kept hundreds of MiB that way, and a second burst added more. Setting the threshold once turns
that adjustment off: every buffer of 1 MiB or more -- a large message, its parsed copy, its text
-- keeps its own mapping and leaves with it (glibc only).

A request refused for its size is freed late, though: the exception that refused it carries
the handler frames that hold the message, and those sit in reference cycles that only Python's
cyclic collector frees, whenever it next runs (measured: five bursts of seven 12 MB requests
left the gateway 200-500 MiB larger). ``Collector.soon`` runs that collection shortly after
such a refusal, at most once per ``COLLECT_DELAY_S``.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger(__name__)

# After a refusal, wait this long (the rest of a burst is refused meanwhile) before collecting.
COLLECT_DELAY_S = 0.5
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


class Collector:
    """Runs Python's cyclic garbage collector soon, once for any number of calls meanwhile."""

    def __init__(self, delay_s: float = COLLECT_DELAY_S):
        self.delay_s = delay_s
        self._pending: asyncio.TimerHandle | None = None

    def soon(self) -> None:
        if self._pending is None:
            self._pending = asyncio.get_running_loop().call_later(self.delay_s, self._collect)

    def _collect(self) -> None:
        self._pending = None
        gc.collect()
