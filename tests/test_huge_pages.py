"""splitserve/common/huge_pages.py: which mappings are moved, and a real process's memory moved."""
import json
import subprocess
import sys

import pytest

from splitserve.common.huge_pages import (HUGE_PAGE_BYTES, MIN_RESIDENT_PAGES, anonymous_ranges, collapse_supported,
                                          filled_runs, thp_setting)

MAPS = """\
55d0c0000000-55d0c0a00000 r-xp 00000000 fd:01 1234   /usr/bin/python3.11
55d0c1000000-55d0c1200000 rw-p 00a00000 fd:01 1234   /usr/bin/python3.11
55d0c2000000-55d0c5100000 rw-p 00000000 00:00 0      [heap]
7f0000100000-7f0000700000 rw-p 00000000 00:00 0
7f0001000000-7f0001100000 rw-p 00000000 00:00 0
7f0002000000-7f0002400000 r--p 00000000 00:00 0
7f0003000000-7f0003400000 rw-s 00000000 00:05 77     /dev/shm/splitserve-kv
7ffd00000000-7ffd00400000 rw-p 00000000 00:00 0      [stack]
"""


def test_only_private_writable_anonymous_memory_is_moved_in_whole_huge_pages():
    assert anonymous_ranges(MAPS) == [
        (0x55d0c2000000, 0x55d0c5000000),  # the heap, its last partial huge page left out
        (0x7f0000200000, 0x7f0000600000),  # an anonymous mapping, trimmed to 2 MiB boundaries
    ]  # not: a file's data, a 1 MiB mapping, read-only memory, shared memory, the stack
    assert all(start % HUGE_PAGE_BYTES == 0 and end % HUGE_PAGE_BYTES == 0 for start, end in anonymous_ranges(MAPS))


def test_only_blocks_mostly_resident_are_taken_and_neighbours_go_in_one_call():
    per_block = HUGE_PAGE_BYTES // 4096
    full, half, sparse = b"\x01" * per_block, b"\x01" * MIN_RESIDENT_PAGES + b"\x00" * (per_block - MIN_RESIDENT_PAGES), \
        b"\x01" + b"\x00" * (per_block - 1)
    start = 64 * HUGE_PAGE_BYTES
    # The upper bits of mincore's bytes are reserved: only bit 0 counts.
    assert filled_runs(start, full + half.replace(b"\x01", b"\x81") + sparse + full) == [
        (start, start + 2 * HUGE_PAGE_BYTES), (start + 3 * HUGE_PAGE_BYTES, start + 4 * HUGE_PAGE_BYTES)]
    assert filled_runs(start, sparse * 3) == []


# A process with 96 MiB of anonymous memory (touched) and 64 MiB barely touched, before and after it settles.
PROCESS = """
import json, mmap, sys
from splitserve.common.huge_pages import anonymous_bytes, settle_in_huge_pages
buffer = bytearray(96 << 20)
for i in range(0, len(buffer), 4096):
    buffer[i] = 1
sparse = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(0, len(sparse), 2 << 20):
    sparse[i] = 1
before = anonymous_bytes()
settled = settle_in_huge_pages()
print(json.dumps({"before": before, "skipped": settled.skipped, "settled": settled.__dict__, **anonymous_bytes()}))
"""


@pytest.mark.skipif(not collapse_supported(), reason="no MADV_COLLAPSE here (Linux 6.1+, THP not never)")
def test_a_process_memory_goes_into_huge_pages():
    out = subprocess.run([sys.executable, "-c", PROCESS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    if thp_setting() == "madvise":  # (with "always" the kernel gives huge pages unasked)
        assert result["before"]["AnonHugePages"] < 16 << 20, result  # small pages until told
    assert result["skipped"] == "", result
    assert result["AnonHugePages"] >= 90 << 20, result  # the kernel's own count: the buffer is in huge pages
    assert result["settled"]["huge_after"] == result["AnonHugePages"]
    # The barely touched mapping was left alone: resident memory did not grow by its 64 MiB.
    assert result["Anonymous"] - result["before"]["Anonymous"] < 16 << 20, result
