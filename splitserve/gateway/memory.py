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
such a refusal, at each of ``COLLECT_DELAYS_S`` (one round per burst).

What the collection frees below the mmap threshold (the many smaller pieces a 12 MB message
passes through on its way in) goes back to the free lists of the malloc arena of whichever
thread held it, and glibc gives an arena's free pages back only from its top. Measured on a
stack after six bursts of seven 12 MB requests: 275 MiB settled, 165 MiB after ``malloc_trim``,
and the settled size grew from burst to burst (186, 200, 203, 253, 233, 275 MiB). So each
collection here is followed by ``malloc_trim(0)``, which hands every arena's free pages back.
"""
from __future__ import annotations

import asyncio
import gc
import logging

from splitserve.common.malloc import libc, return_free_pages

log = logging.getLogger(__name__)

# After a refusal, collect at each of these delays: the first once the rest of a burst is refused,
# the later ones for requests whose handlers were still unwinding then (a loaded machine spreads a
# burst out: one collection left ~300 MiB behind in a CI run, and two, at 0.5 and 5 s, left
# ~330 MiB of a third burst in another).
COLLECT_DELAYS_S = (0.5, 5.0, 10.0)
M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20


def return_big_buffers() -> bool:
    """Fix glibc's mmap threshold at ``MMAP_THRESHOLD_BYTES``; False where there is no glibc."""
    c = libc()
    ok = c is not None and hasattr(c, "mallopt") and c.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    if not ok:
        log.info("mallopt unavailable: large freed buffers may stay in the heap")
    return ok


class Collector:
    """Runs Python's cyclic garbage collector soon (at each of ``delays_s``), once for any number
    of calls meanwhile."""

    def __init__(self, delays_s: tuple[float, ...] = COLLECT_DELAYS_S):
        self.delays_s = delays_s
        self._pending: list[asyncio.TimerHandle] = []

    def soon(self) -> None:
        if not self._pending:
            loop = asyncio.get_running_loop()
            self._pending = [loop.call_later(d, self._collect, d == self.delays_s[-1]) for d in self.delays_s]

    def _collect(self, last: bool) -> None:
        if last:
            self._pending = []
        gc.collect()
        return_free_pages()  # what the collection freed, out of the arenas (module docstring)
