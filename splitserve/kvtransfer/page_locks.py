"""Who is copying into which page of a shared pool, across processes: byte-range locks, one byte a page.

A same-host sender (shm, cuda_ipc) writes straight into the decode worker's pool from its own
process. It checks that the destination pages still carry its lease's epoch before each copy,
but a check is not a guarantee: the decode worker can release the lease (an abort, an expiry)
between the check and the end of the copy, hand the pages to the next request, and the late
copy would then overwrite that request's KV. So a sender holds a *shared* lock on the pages'
bytes of the pool's lock file from before its check until its bytes have landed, and the decode
worker, after fencing a released lease's pages (the epoch cleared), takes an *exclusive* lock on
them without waiting: granted, no copy is under way and none can start (a sender that locks
after it sees the cleared epoch); refused, a copy is under way, and the pages stay set aside
until a later try is granted.

The locks are Linux open-file-description locks (``F_OFD_SETLK``): they belong to an open file,
not to a process, so two opens in one process exclude each other as two processes do, and the
kernel drops them when the file is closed, also when its process is killed, so a dead sender
never keeps pages set aside. Taking and dropping one costs a system call, which also orders the
epoch's store before the check on the other side.
"""
from __future__ import annotations

import errno
import fcntl
import os
import struct
from pathlib import Path
from typing import Iterable, Iterator, Sequence

# struct flock on Linux: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid
# (0 for OFD locks), padded to 32 bytes.
_FLOCK = "hhqqi4x"


def page_ranges(pages: Iterable[int]) -> Iterator[tuple[int, int]]:
    """(first page, count) of each run of consecutive ids, in sorted order."""
    start = count = None
    for page in sorted(set(pages)):
        if start is not None and page == start + count:
            count += 1
            continue
        if start is not None:
            yield start, count
        start, count = page, 1
    if start is not None:
        yield start, count


# Past this many separate ranges a sender locks the one range that spans them: two system calls
# per copy, not two per range of a fragmented page table. Pages of other requests inside it are
# only ever set aside a little longer, never written.
MAX_RANGES = 8


def destination_ranges(runs: Iterable[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The (first page, count) ranges a sender locks for page ``runs`` (src, dst, count)."""
    ranges: list[tuple[int, int]] = []
    for _, start, count in sorted(runs, key=lambda run: run[1]):
        if ranges and ranges[-1][0] + ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + count)
        else:
            ranges.append((start, count))
    if len(ranges) > MAX_RANGES:
        end = max(start + count for start, count in ranges)
        ranges = [(ranges[0][0], end - ranges[0][0])]
    return ranges


class PageLocks:
    """Byte-range locks on ``path`` (one byte per page), through an open file of this object's own."""

    def __init__(self, path: str | os.PathLike, fd: int | None = None):
        """Opens ``path`` (never through a link), or takes a copy of ``fd``, an open file of it."""
        self.path = Path(path)
        self.fd = os.dup(fd) if fd is not None else os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)

    def _lock(self, kind: int, ranges: Iterable[tuple[int, int]], wait: bool) -> list[tuple[int, int]]:
        """Lock every (first page, count) range; all or none (what was taken is dropped on a refusal)."""
        taken: list[tuple[int, int]] = []
        command = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
        for start, count in ranges:
            try:
                fcntl.fcntl(self.fd, command, struct.pack(_FLOCK, kind, os.SEEK_SET, start, count, 0))
            except OSError as e:
                self._unlock(taken)
                if e.errno in (errno.EAGAIN, errno.EACCES):
                    return []
                raise
            taken.append((start, count))
        return taken

    def _unlock(self, ranges: Sequence[tuple[int, int]]) -> None:
        for start, count in ranges:
            fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, fcntl.F_UNLCK, os.SEEK_SET, start, count, 0))

    def hold_shared(self, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """A sender's: wait for (at most a decode worker's brief try) and hold a shared lock on
        the pages of ``ranges`` (first page, count); ``release`` what it returns."""
        return self._lock(fcntl.F_RDLCK, ranges, wait=True)

    def release(self, ranges: Sequence[tuple[int, int]]) -> None:
        self._unlock(ranges)

    def quiet(self, pages: Sequence[int]) -> bool:
        """The decode worker's: True when no sender holds any of ``pages`` (an exclusive lock on
        them was granted, and dropped again at once); False when one is copying into them."""
        if not pages:
            return True
        taken = self._lock(fcntl.F_WRLCK, page_ranges(pages), wait=False)
        if not taken:
            return False
        self._unlock(taken)
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
