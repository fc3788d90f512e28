"""A late copy never lands in another request's pages (issue 36, point 5).

A shm sender in another process checks the destination pages' epoch, then copies. If the decode
side ends the lease between the two (an abort, an expiry), the pages must not go to the next
request until that copy has stopped: they are set aside while the sender holds its page locks,
and freed once it has dropped them, or died. The sender here is a real process whose copy is
held open at the point a descheduled or stopped process would be.
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.engine.attention.page_order import HEAD_MAJOR, order_of, pages_of
from splitserve.engine.config import EngineConfig
from splitserve.kvtransfer.page_locks import MAX_RANGES, PageLocks, destination_ranges, page_ranges
from splitserve.worker.wiring import build_decode

ROOT = Path(__file__).resolve().parents[1]
BLOCKS, BLOCK_SIZE = 16, 8

# A sender process: its first copy waits for a line on stdin after the epoch check passed (the
# window in which a lease can end), then lands; a second layer's write follows.
SLOW_SENDER = """
import json, sys, types
import torch
from splitserve.kvtransfer.transports import shm
spec = json.loads(sys.argv[1])
copy_runs, held_up = shm.copy_runs, []
def copy_after_a_line(src, dst, runs):
    if not held_up:
        held_up.append(1)
        print("copying", flush=True)
        sys.stdin.readline()
    return copy_runs(src, dst, runs)
shm.copy_runs = copy_after_a_line
pages = torch.full(spec["pages_shape"], 7.0)  # laid out as the decode pool's pages are
sender = shm.ShmSender(spec["address"], pages.transpose(3, 4) if spec["head_major"] else pages)
desc = types.SimpleNamespace(request_id=spec["request_id"], epoch=spec["epoch"])
runs = [(i, block, 1) for i, block in enumerate(spec["blocks"])]
sender.write(desc, 0, runs)
print("landed", flush=True)
try:
    sender.write(desc, 1, runs)
    print("second layer written", flush=True)
except Exception as e:
    print(type(e).__name__, flush=True)
"""


@pytest.fixture
def decode(tiny_model_dirs, private_shm):
    connector = build_decode(EngineConfig(model=str(tiny_model_dirs["llama"]), dtype="float32", enforce_eager=True,
                                          num_gpu_blocks=BLOCKS, block_size=BLOCK_SIZE), "shm")
    yield connector
    connector.close()


def start_sender(decode, desc) -> subprocess.Popen:
    spec = {"address": desc.address, "request_id": desc.request_id, "epoch": desc.epoch,
            "blocks": list(desc.block_ids), "pages_shape": list(pages_of(decode.engine.kv_cache).shape),
            "head_major": order_of(decode.engine.kv_cache) == HEAD_MAJOR}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SENDER, json.dumps(spec)], cwd=ROOT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "copying", "the sender did not reach its copy"
    return proc


def layer0(decode, blocks):
    """Layer 0's K and V of ``blocks`` (a copy)."""
    return decode.engine.kv_cache[0, :, list(blocks)]


def test_pages_a_sender_is_copying_into_go_to_nobody_until_the_copy_stopped(decode):
    a = decode.reserve("a", 4 * BLOCK_SIZE)
    sender = start_sender(decode, a)
    try:
        assert decode.abort("a")  # mid-copy: the lease ends, the pages are fenced...
        assert list(decode.set_aside.values()) == [a.block_ids]
        # ... but not free: a request given them now would have its KV overwritten.
        assert decode.reserve("everything", BLOCKS * BLOCK_SIZE) is None
        assert decode.sweep() == 0
        b = decode.reserve("b", (BLOCKS - 4) * BLOCK_SIZE)  # what is free: the other pages
        assert b is not None and not set(b.block_ids) & set(a.block_ids)
        decode.engine.kv_cache[0, :, list(b.block_ids)] = 3.0  # b's KV, as its own prefill would write it
        sender.stdin.write("\n")
        sender.stdin.flush()
        assert sender.stdout.readline().strip() == "landed"
        # Its next write sees the cleared epoch and stops.
        assert sender.stdout.readline().strip() == "StaleEpochError"
        assert sender.wait(30) == 0
    finally:
        sender.kill()
    assert bool((layer0(decode, a.block_ids) == 7.0).all())  # the late copy landed in nobody's pages
    assert bool((layer0(decode, b.block_ids) == 3.0).all())  # b's KV is untouched
    assert decode.sweep() == 4 and not decode.set_aside
    decode.abort("b")  # no sender: freed at once
    assert not decode.set_aside
    decode.engine.assert_idle()


def test_a_request_id_set_aside_can_reserve_again(decode):
    """The gateway may retry the same request on this worker at once: its new reservation takes
    other pages while the old ones wait for the copy."""
    a = decode.reserve("a", 4 * BLOCK_SIZE)
    sender = start_sender(decode, a)
    try:
        decode.abort("a")
        again = decode.reserve("a", 4 * BLOCK_SIZE)
        assert again is not None and not set(again.block_ids) & set(a.block_ids)
        assert again.epoch != a.epoch
    finally:
        sender.kill()
        sender.wait(10)
    decode.abort("a")
    assert decode.sweep() == 4 and not decode.set_aside
    decode.engine.assert_idle()


def test_a_sender_killed_mid_copy_does_not_keep_pages_set_aside(decode):
    a = decode.reserve("a", BLOCKS * BLOCK_SIZE)
    sender = start_sender(decode, a)
    decode.abort("a")
    assert decode.sweep() == 0
    sender.send_signal(signal.SIGKILL)
    sender.wait(10)
    # The kernel dropped the dead process's locks with its files.
    assert decode.sweep() == BLOCKS
    assert decode.reserve("b", BLOCK_SIZE) is not None
    decode.abort("b")
    decode.engine.assert_idle()


def test_expired_leases_free_their_pages_through_the_same_fence(decode):
    """reap_expired ends leases as abort does, and sweeps what was set aside before."""
    a = decode.reserve("a", 2 * BLOCK_SIZE)
    sender = start_sender(decode, a)
    try:
        decode.leases.get("a").deadline = 0.0  # its prefill went quiet
        assert decode.reap_expired() == ["a"]
        assert list(decode.set_aside.values()) == [a.block_ids]
    finally:
        sender.kill()
        sender.wait(10)
    decode.reap_expired()
    assert not decode.set_aside
    decode.engine.assert_idle()


def test_page_locks_exclude_each_other_within_one_process_too(tmp_path):
    path = tmp_path / "owners"
    path.write_bytes(bytes(64))
    sender, decode = PageLocks(path), PageLocks(path)
    try:
        held = sender.hold_shared([(2, 3)])
        assert not decode.quiet([1, 3]) and decode.quiet([0, 1, 5, 6])
        sender.release(held)
        assert decode.quiet([1, 3])
        sender.hold_shared([(4, 1)])
        sender.close()  # a closed file (as a dead process's) holds nothing
        assert decode.quiet([4])
    finally:
        decode.close()


def test_page_ranges():
    assert list(page_ranges([5, 1, 2, 3, 9, 10, 3])) == [(1, 3), (5, 1), (9, 2)]
    assert list(page_ranges([])) == []
    # A sender's: adjacent destination runs merge; a fragmented table is locked as one span.
    assert destination_ranges([(0, 9, 2), (2, 4, 3), (5, 7, 2)]) == [(4, 7)]
    assert destination_ranges([(0, 1, 1), (1, 5, 1)]) == [(1, 1), (5, 1)]
    scattered = [(i, 3 * i, 1) for i in range(MAX_RANGES + 1)]
    assert destination_ranges(scattered) == [(0, 3 * MAX_RANGES + 1)]
