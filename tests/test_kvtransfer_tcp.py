"""tcp KV transport: byte-exact page runs over loopback, fencing by epoch/lease, hostile peers."""
from __future__ import annotations

import os
import random
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvtransfer.base import (KVLayout, LayoutMismatchError, LeaseExpiredError, StaleEpochError,
                             TransferAbortedError, TransferDescriptor, TransferError,
                             TransportUnavailableError, coalesce)
from kvtransfer.lease import LeaseTable, PageFence
from kvtransfer.transports import tcp
from kvtransfer.transports.tcp import TcpReceiver, TcpSender

REPO = Path(__file__).resolve().parents[1]
H, D = 2, 8


def make_pool(layers=2, blocks=32, bs=8, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.randn(layers, 2, blocks, bs, H, D).to(dtype)


def make_leases(blocks, ttl_s=60.0, clock=time.time):
    return LeaseTable(PageFence(torch.empty(blocks, dtype=torch.int64)), ttl_s=ttl_s, clock=clock)


def descriptor(rid, receiver, dst_blocks, pool, lease):
    return TransferDescriptor(rid, "tcp", receiver.address, tuple(dst_blocks), KVLayout.of_pool("m", pool),
                              lease.epoch, lease.deadline)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture
def cleanup():
    things = []
    yield things.append
    for t in reversed(things):
        t.close()


def receiver_for(cleanup, dst_pool, leases, **kw):
    receiver = TcpReceiver(dst_pool, leases, **kw)
    cleanup(receiver)
    return receiver


def transfer(receiver, src_pool, dst_pool, leases, rid, src_blocks, dst_blocks, cleanup, **kw):
    lease = leases.grant(rid, dst_blocks)
    desc = descriptor(rid, receiver, dst_blocks, dst_pool, lease)
    sender = TcpSender(receiver.address, src_pool, **kw)
    cleanup(sender)
    runs = coalesce(src_blocks, dst_blocks)
    for layer in range(src_pool.shape[0]):
        sender.write(desc, layer, runs)
    sender.flush(desc)
    return sender, runs, lease


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [8, 16])
@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("fragmented", [False, True])
def test_pages_arrive_byte_exact(cleanup, dtype, bs, layers, fragmented):
    blocks, n = 48, 12
    src, dst = make_pool(layers, blocks, bs, dtype, seed=1), make_pool(layers, blocks, bs, dtype, seed=2)
    before = dst.clone()
    rng = random.Random(f"{dtype}{bs}{layers}{fragmented}")
    if fragmented:
        src_blocks, dst_blocks = rng.sample(range(blocks), n), rng.sample(range(blocks), n)
    else:
        s0, d0 = rng.randrange(blocks - n), rng.randrange(blocks - n)
        src_blocks, dst_blocks = list(range(s0, s0 + n)), list(range(d0, d0 + n))
    leases = make_leases(blocks)
    receiver = receiver_for(cleanup, dst, leases)
    sender, runs, _ = transfer(receiver, src, dst, leases, "r", src_blocks, dst_blocks, cleanup)
    assert same_bytes(dst[:, :, dst_blocks], src[:, :, src_blocks])
    others = [b for b in range(blocks) if b not in dst_blocks]
    assert same_bytes(dst[:, :, others], before[:, :, others])  # nothing else touched
    assert len(runs) == 1 if not fragmented else len(runs) > 1
    assert sender.num_copies == len(runs) * layers
    assert sender.bytes_sent == 2 * n * layers * KVLayout.of_pool("m", src).page_bytes


def test_large_run_is_split_into_bounded_frames(cleanup):
    src, dst = make_pool(2, 64, 16, torch.bfloat16, seed=3), make_pool(2, 64, 16, torch.bfloat16, seed=4)
    page_bytes = KVLayout.of_pool("m", src).page_bytes  # 16*2*8*2 = 512
    leases = make_leases(64)
    receiver = receiver_for(cleanup, dst, leases)
    sender, runs, _ = transfer(receiver, src, dst, leases, "big", list(range(0, 40)), list(range(20, 60)), cleanup,
                               max_frame_bytes=2 * 7 * page_bytes)  # 7 pages of K+V per frame
    assert len(runs) == 1 and sender.num_copies == 2 * 6  # ceil(40 / 7) frames per layer
    assert same_bytes(dst[:, :, 20:60], src[:, :, 0:40])


def test_strided_pools_go_through_staging(cleanup):
    wide_src, wide_dst = make_pool(2, 16, seed=19), make_pool(2, 16, seed=20)
    src, dst = wide_src.transpose(-1, -2), wide_dst.transpose(-1, -2)  # [.., D, H]: not contiguous
    assert not src.is_contiguous() and not dst.is_contiguous()
    leases = make_leases(16)
    receiver = receiver_for(cleanup, dst, leases)
    transfer(receiver, src, dst, leases, "r", [0, 5, 6, 7], [9, 1, 2, 3], cleanup)
    assert same_bytes(dst[:, :, [9, 1, 2, 3]], src[:, :, [0, 5, 6, 7]])


def test_release_mid_transfer_refuses_later_writes(cleanup):
    src, dst = make_pool(3, 16, seed=5), make_pool(3, 16, seed=6)
    leases = make_leases(16)
    receiver = receiver_for(cleanup, dst, leases)
    blocks = [3, 4, 9]
    lease = leases.grant("r", blocks)
    desc = descriptor("r", receiver, blocks, dst, lease)
    sender = TcpSender(receiver.address, src)
    cleanup(sender)
    runs = coalesce(blocks, blocks)
    sender.write(desc, 0, runs)
    sender.flush(desc)  # layer 0 landed
    assert same_bytes(dst[0][:, blocks], src[0][:, blocks])
    before = dst.clone()
    leases.release("r")
    leases.grant("r", blocks)  # re-issued under a new epoch: the old attempt is fenced off
    sender.write(desc, 1, runs)
    sender.write(desc, 2, runs)
    with pytest.raises(StaleEpochError, match="stale|do not belong"):
        sender.flush(desc)
    assert same_bytes(dst, before)
    # The connection stays usable; a flush after release (no write in between) is refused too.
    leases.release("r")
    with pytest.raises(StaleEpochError):
        sender.flush(desc)


def test_expired_lease_refuses_writes_and_flush(cleanup):
    now = [1000.0]
    src, dst = make_pool(2, 16, seed=7), make_pool(2, 16, seed=8)
    leases = make_leases(16, ttl_s=5.0, clock=lambda: now[0])
    receiver = receiver_for(cleanup, dst, leases)
    lease = leases.grant("r", [0, 1, 2])
    desc = descriptor("r", receiver, [0, 1, 2], dst, lease)
    sender = TcpSender(receiver.address, src)
    cleanup(sender)
    sender.write(desc, 0, [(5, 0, 3)])
    sender.flush(desc)
    now[0] += 10.0
    before = dst.clone()
    sender.write(desc, 1, [(5, 0, 3)])
    with pytest.raises(LeaseExpiredError):
        sender.flush(desc)
    assert same_bytes(dst, before)
    assert same_bytes(dst[0, :, 0:3], src[0, :, 5:8])


def test_writes_outside_the_reservation_are_refused(cleanup):
    src, dst = make_pool(1, 16, seed=9), make_pool(1, 16, seed=10)
    leases = make_leases(16)
    receiver = receiver_for(cleanup, dst, leases)
    lease = leases.grant("r", [0, 1])
    desc = descriptor("r", receiver, [0, 1], dst, lease)
    sender = TcpSender(receiver.address, src)
    cleanup(sender)
    before = dst.clone()
    sender.write(desc, 0, [(0, 1, 2)])  # page 2 belongs to nobody
    with pytest.raises(StaleEpochError, match="do not belong"):
        sender.flush(desc)
    assert same_bytes(dst, before)


def raw_exchange(address: str, data: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_malformed_frames_close_only_their_connection(cleanup):
    src, dst = make_pool(2, 16, seed=11), make_pool(2, 16, seed=12)
    leases = make_leases(16)
    receiver = receiver_for(cleanup, dst, leases)
    lease = leases.grant("victim", [4, 5])
    page2 = 2 * 2 * KVLayout.of_pool("m", dst).page_bytes
    rid, ep = b"victim", lease.epoch
    bad_frames = {
        "garbage": os.urandom(tcp.HEADER.size + 100),
        "magic": tcp.HEADER.pack(b"HTTP", 1, tcp.WRITE, 0, 6, ep, 0, 4, 2, page2) + rid + b"\0" * page2,
        "version": tcp.HEADER.pack(tcp.MAGIC, 9, tcp.WRITE, 0, 6, ep, 0, 4, 2, page2) + rid,
        "type": tcp.frame(77, rid, ep),
        "layer": tcp.frame(tcp.WRITE, rid, ep, 2, 4, 2, page2) + b"\0" * page2,
        "block": tcp.frame(tcp.WRITE, rid, ep, 0, 15, 2, page2),
        "empty run": tcp.frame(tcp.WRITE, rid, ep, 0, 4, 0, 0),
        "length": tcp.frame(tcp.WRITE, rid, ep, 0, 4, 2, page2 + 1) + b"\0" * (page2 + 1),
        "rid length": tcp.HEADER.pack(tcp.MAGIC, 1, tcp.WRITE, 0, 60000, ep, 0, 4, 2, page2),
        "rid utf8": tcp.frame(tcp.WRITE, b"\xff\xfe", ep, 0, 4, 2, page2),
        "flush payload": tcp.frame(tcp.FLUSH, rid, ep, payload_len=5) + b"hello",
        "truncated": tcp.frame(tcp.WRITE, rid, ep, 0, 4, 2, page2)[:20],
        "cut payload": tcp.frame(tcp.WRITE, rid, ep, 0, 4, 2, page2) + b"\0" * 10,
    }
    before = dst.clone()
    for name, data in bad_frames.items():
        reply = raw_exchange(receiver.address, data)
        if name in ("truncated", "cut payload"):
            continue  # the peer hung up: nothing to answer
        assert len(reply) >= tcp.HEADER.size, name
        fields = tcp.HEADER.unpack(reply[:tcp.HEADER.size])
        assert fields[0] == tcp.MAGIC and fields[2] == tcp.ERROR and fields[3] == tcp.ABORTED, name
    # "cut payload" wrote 10 bytes of zeros into page 4 before the peer vanished; the rest is as it was
    assert same_bytes(dst[:, :, [0, 1, 2, 3, 6, 7]], before[:, :, [0, 1, 2, 3, 6, 7]])
    leases.release("victim")
    # The receiver still serves a correct transfer.
    transfer(receiver, src, dst, leases, "ok", [0, 1, 7], [8, 9, 10], cleanup)
    assert same_bytes(dst[:, :, 8:11], src[:, :, [0, 1, 7]])
    deadline = time.monotonic() + 3
    while receiver.num_connections > 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert receiver.num_connections == 1  # only the live sender's


def test_sender_surfaces_protocol_errors(cleanup):
    src, dst = make_pool(1, 16, seed=13), make_pool(1, 8, seed=14)  # receiver pool is smaller
    leases = make_leases(8)
    receiver = receiver_for(cleanup, dst, leases)
    lease = leases.grant("r", [6, 7])
    sender = TcpSender(receiver.address, src)
    cleanup(sender)
    desc = descriptor("r", receiver, [6, 7], dst, lease)
    sender.write(desc, 0, [(0, 12, 2)])  # pages 12..13 do not exist on the decode side
    with pytest.raises(TransferAbortedError, match="outside the pool|connection"):
        sender.flush(desc)
    with pytest.raises(TransferAbortedError, match="unusable"):
        sender.write(desc, 0, [(0, 6, 2)])


def test_layout_mismatch_and_unreachable_address(cleanup):
    dst = make_pool(1, 8)
    receiver = receiver_for(cleanup, dst, make_leases(8))
    lease = receiver.leases.grant("r", [0])
    sender = TcpSender(receiver.address, make_pool(1, 8, dtype=torch.bfloat16))
    cleanup(sender)
    with pytest.raises(LayoutMismatchError, match="dtype"):
        sender.write(descriptor("r", receiver, [0], dst, lease), 0, [(0, 0, 1)])
    assert sender.bytes_sent == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(TransportUnavailableError, match=dead):
        TcpSender(dead, dst, timeout_s=2)
    with pytest.raises(TransportUnavailableError, match="no-port"):
        TcpSender("no-port", dst)


def test_receiver_gone_or_silent_fails_the_flush_quickly(cleanup):
    src, dst = make_pool(2, 16, seed=15), make_pool(2, 16, seed=16)
    leases = make_leases(16)
    receiver = receiver_for(cleanup, dst, leases)
    lease = leases.grant("r", [0, 1])
    desc = descriptor("r", receiver, [0, 1], dst, lease)
    sender = TcpSender(receiver.address, src, timeout_s=2.0)
    cleanup(sender)
    sender.write(desc, 0, [(0, 0, 2)])
    receiver.close()
    t0 = time.monotonic()
    with pytest.raises(TransferAbortedError):
        sender.write(desc, 1, [(0, 0, 2)])
        sender.flush(desc)
    assert time.monotonic() - t0 < 3.0
    # A peer that accepts but never answers: the flush gives up after timeout_s.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        sender = TcpSender(f"127.0.0.1:{silent.getsockname()[1]}", src, timeout_s=0.5)
        cleanup(sender)
        sender.write(desc, 0, [(0, 0, 2)])
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="did not answer"):
            sender.flush(desc)
        assert time.monotonic() - t0 < 2.0


CHILD = """
import sys, time, torch
from kvtransfer.base import KVLayout, TransferDescriptor
from kvtransfer.transports import tcp
address, epoch = sys.argv[1], int(sys.argv[2])
pool = torch.randn(2, 2, 16, 8, 2, 8)
sender = tcp.TcpSender(address, pool)
desc = TransferDescriptor("child", "tcp", address, (4, 5, 6), KVLayout.of_pool("m", pool), epoch, 0.0)
sender.write(desc, 0, [(0, 4, 3)])
sender.flush(desc)
page2 = 2 * 3 * KVLayout.of_pool("m", pool).page_bytes
sender.sock.sendall(tcp.frame(tcp.WRITE, b"child", epoch, 1, 4, 3, page2) + b"\\0" * (page2 // 3))
print("MID", flush=True)
time.sleep(60)
"""


def test_sender_process_killed_mid_frame(cleanup):
    src, dst = make_pool(2, 16, seed=17), make_pool(2, 16, seed=18)
    leases = make_leases(16)
    receiver = receiver_for(cleanup, dst, leases, timeout_s=30.0)
    lease = leases.grant("child", [4, 5, 6])
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    child = subprocess.Popen([sys.executable, "-c", CHILD, receiver.address, str(lease.epoch)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 20)
        if not ready or child.stdout.readline().strip() != b"MID":
            child.kill()
            pytest.fail(f"the sender process did not start: {child.stderr.read().decode()[-2000:]}")
        # The receiver is inside the half-sent frame, holding the fence: release() would wait.
        deadline, held = time.monotonic() + 5, False
        while not held and time.monotonic() < deadline:
            if leases.fence.lock.acquire(blocking=False):
                leases.fence.lock.release()
                time.sleep(0.01)
            else:
                held = True
        assert held
    finally:
        child.kill()
        child.wait(10)
        child.stdout.close()
        child.stderr.close()
    released = threading.Thread(target=leases.release, args=("child",), daemon=True)
    t0 = time.monotonic()
    released.start()
    released.join(5)
    assert not released.is_alive() and time.monotonic() - t0 < 3.0
    assert leases.get("child") is None
    transfer(receiver, src, dst, leases, "next", [1, 2, 3], [4, 5, 6], cleanup)
    assert same_bytes(dst[:, :, 4:7], src[:, :, 1:4])
