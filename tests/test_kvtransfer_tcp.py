"""tcp KV transport: byte-exact page runs over loopback, fencing by epoch/lease, hostile peers."""
from __future__ import annotations

import os
import random
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from splitserve.kvtransfer.base import (KVLayout, LayoutMismatchError, LeaseExpiredError, StaleEpochError,
                             TransferAbortedError, TransferDescriptor, TransferError,
                             TransportUnavailableError, coalesce)
from splitserve.kvtransfer.lease import LeaseTable, PageFence
from splitserve.kvtransfer.transports import tcp, tcp_sender
from splitserve.kvtransfer.transports.tcp import TcpReceiver
from splitserve.kvtransfer.transports.tcp_sender import TcpSender
from tests.kv_pools import QUANTIZED, random_pool

REPO = Path(__file__).resolve().parents[1]
H, D = 2, 8


def make_pool(layers=2, blocks=32, bs=8, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return random_pool((layers, 2, blocks, bs, H, D), dtype)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, *QUANTIZED])
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
    assert len(runs) == 1 if not fragmented else len(runs) >= tcp_sender.PACK_MIN_RUNS
    assert sender.num_copies == len(runs) * layers
    assert sender.num_frames == (layers if fragmented else len(runs) * layers)  # fragmented: one PACKED per layer
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


@pytest.mark.parametrize("src_blocks, dst_blocks", [([0, 5, 6, 7], [9, 1, 2, 3]),  # 2 runs: WRITE frames
                                                    ([0, 5, 6, 7, 12, 3], [9, 1, 2, 14, 4, 11])])  # PACKED
def test_strided_pools_go_through_staging(cleanup, src_blocks, dst_blocks):
    wide_src, wide_dst = make_pool(2, 16, seed=19), make_pool(2, 16, seed=20)
    src, dst = wide_src.transpose(-1, -2), wide_dst.transpose(-1, -2)  # [.., D, H]: not contiguous
    assert not src.is_contiguous() and not dst.is_contiguous()
    leases = make_leases(16)
    receiver = receiver_for(cleanup, dst, leases)
    transfer(receiver, src, dst, leases, "r", src_blocks, dst_blocks, cleanup)
    assert same_bytes(dst[:, :, dst_blocks], src[:, :, src_blocks])


def fragmented_pages(rng, blocks, lengths):
    """(src, dst) page lists that coalesce into exactly ``len(lengths)`` runs of those lengths: on both
    sides the runs lie apart (a gap between any two), and the destination takes them in random order."""
    def runs(order):
        starts = sorted(rng.sample(range(blocks - 2 * sum(lengths)), len(lengths)))
        placed = {}
        for k, (start, i) in enumerate(zip(starts, order)):
            offset = sum(lengths[j] + 1 for j in order[:k])  # earlier runs plus a gap each
            placed[i] = list(range(start + offset, start + offset + lengths[i]))
        return [b for i in range(len(lengths)) for b in placed[i]]
    order = list(range(len(lengths)))
    rng.shuffle(order)
    return runs(list(range(len(lengths)))), runs(order)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, *QUANTIZED])
def test_packed_runs_arrive_byte_exact(cleanup, dtype):
    layers, blocks = 3, 128
    rng = random.Random(str(dtype))
    lengths = [rng.randint(1, 4) for _ in range(20)]
    src_blocks, dst_blocks = fragmented_pages(rng, blocks, lengths)
    src, dst = make_pool(layers, blocks, 16, dtype, seed=21), make_pool(layers, blocks, 16, dtype, seed=22)
    before = dst.clone()
    leases = make_leases(blocks)
    receiver = receiver_for(cleanup, dst, leases)
    sender, runs, _ = transfer(receiver, src, dst, leases, "p", src_blocks, dst_blocks, cleanup)
    assert sorted(n for _, _, n in runs) == sorted(lengths)  # 20 runs, some of several pages
    assert sender.num_frames == layers and sender.num_copies == len(runs) * layers
    assert sender.bytes_sent == 2 * len(dst_blocks) * layers * KVLayout.of_pool("m", src).page_bytes
    assert same_bytes(dst[:, :, dst_blocks], src[:, :, src_blocks])
    others = [b for b in range(blocks) if b not in dst_blocks]
    assert same_bytes(dst[:, :, others], before[:, :, others])


@pytest.mark.parametrize("page_shape", [(1, 1, 3), (3, 1, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_pages_of_odd_sizes(cleanup, page_shape, dtype):
    # Pages of 6..60 bytes: not a multiple of 16, so no wide-element rows; the plain index path is used.
    torch.manual_seed(23)
    src, dst = torch.randn(2, 2, 24, *page_shape).to(dtype), torch.randn(2, 2, 24, *page_shape).to(dtype)
    leases = make_leases(24)
    receiver = receiver_for(cleanup, dst, leases)
    src_blocks, dst_blocks = [3, 4, 9, 1, 20, 21, 22], [0, 1, 5, 7, 10, 11, 23]
    sender, runs, _ = transfer(receiver, src, dst, leases, "odd", src_blocks, dst_blocks, cleanup)
    assert len(runs) >= tcp_sender.PACK_MIN_RUNS and sender.num_frames == 2
    assert same_bytes(dst[:, :, dst_blocks], src[:, :, src_blocks])


def test_packed_write_is_split_into_bounded_frames(cleanup):
    layers, blocks = 2, 96
    src = make_pool(layers, blocks, 16, torch.bfloat16, seed=24)
    dst = make_pool(layers, blocks, 16, torch.bfloat16, seed=25)
    page_bytes = KVLayout.of_pool("m", src).page_bytes
    limit = 5 * (2 * page_bytes + 8)  # 5 pages and their table entries per frame
    leases = make_leases(blocks)
    # The receiver enforces the same limit: a frame over it (table included) would be refused.
    receiver = receiver_for(cleanup, dst, leases, max_frame_bytes=limit)
    rng = random.Random(26)
    lengths = [3, 1, 4, 2, 7, 1, 1, 3, 2]  # 24 pages: runs cut across frame boundaries
    src_blocks, dst_blocks = fragmented_pages(rng, blocks, lengths)
    sender, runs, _ = transfer(receiver, src, dst, leases, "split", src_blocks, dst_blocks, cleanup,
                               max_frame_bytes=limit)
    assert sender.num_frames == layers * 5  # ceil(24 / 5) self-contained frames per layer
    assert len(runs) == len(lengths) and sender.num_copies > len(runs) * layers  # some runs were cut in two
    assert same_bytes(dst[:, :, dst_blocks], src[:, :, src_blocks])


FRAGMENTED = ([0, 1, 2, 3, 4, 5], [1, 3, 5, 7, 9, 11])  # (src, dst): six one-page runs


def test_packed_frames_refused_after_release_or_expiry(cleanup):
    now = [1000.0]
    src, dst = make_pool(3, 16, seed=27), make_pool(3, 16, seed=28)
    leases = make_leases(16, ttl_s=5.0, clock=lambda: now[0])
    receiver = receiver_for(cleanup, dst, leases)
    src_blocks, dst_blocks = FRAGMENTED
    runs = coalesce(src_blocks, dst_blocks)
    sender = TcpSender(receiver.address, src)
    cleanup(sender)
    # Stale: the lease was released and re-issued between layers.
    lease = leases.grant("r", dst_blocks)
    desc = descriptor("r", receiver, dst_blocks, dst, lease)
    sender.write(desc, 0, runs)
    sender.flush(desc)
    assert same_bytes(dst[0][:, dst_blocks], src[0][:, src_blocks])
    leases.release("r")
    leases.grant("r", dst_blocks)
    before = dst.clone()
    sender.write(desc, 1, runs)
    sender.write(desc, 2, runs)
    with pytest.raises(StaleEpochError, match="stale|do not belong"):
        sender.flush(desc)
    assert same_bytes(dst, before) and sender.num_frames == 3
    leases.release("r")
    # Expired: the lease outlived its deadline.
    lease = leases.grant("e", dst_blocks)
    desc = descriptor("e", receiver, dst_blocks, dst, lease)
    now[0] += 10.0
    sender.write(desc, 0, runs)
    with pytest.raises(LeaseExpiredError):
        sender.flush(desc)
    assert same_bytes(dst, before)
    leases.release("e")
    # One page outside the reservation refuses the whole frame.
    lease = leases.grant("part", dst_blocks[:-1])
    desc = descriptor("part", receiver, dst_blocks, dst, lease)
    sender.write(desc, 0, runs)
    with pytest.raises(StaleEpochError, match="do not belong"):
        sender.flush(desc)
    assert same_bytes(dst, before)
    leases.release("part")
    # The same connection still carries a good transfer.
    lease = leases.grant("ok", dst_blocks)
    desc = descriptor("ok", receiver, dst_blocks, dst, lease)
    for layer in range(3):
        sender.write(desc, layer, runs)
    sender.flush(desc)
    assert same_bytes(dst[:, :, dst_blocks], src[:, :, src_blocks])


def test_malformed_packed_frames_are_refused(cleanup):
    src, dst = make_pool(2, 16, seed=29), make_pool(2, 16, seed=30)
    leases = make_leases(16)
    receiver = receiver_for(cleanup, dst, leases, max_frame_bytes=8 << 10)  # 8 pages of K and V
    lease = leases.grant("victim", [2, 4, 6, 8])
    page_bytes = KVLayout.of_pool("m", dst).page_bytes
    rid, ep = b"victim", lease.epoch

    def packed(table, num=None, layer=0, runs=None, nbytes=None, pages=None):
        """A PACKED frame for ``table`` [(dst, n), ...]; any field can be made wrong on purpose."""
        num = sum(n for _, n in table) if num is None else num
        body = b"".join(struct.pack("!II", d, n) for d, n in table)
        payload = b"\7" * (2 * (num if pages is None else pages) * page_bytes)
        nbytes = len(body) + len(payload) if nbytes is None else nbytes
        header = tcp.frame(tcp.PACKED, rid, ep, layer, len(table) if runs is None else runs, num, nbytes)
        return header + body + payload

    good = [(2, 1), (4, 1), (6, 1), (8, 1)]
    bad_frames = {  # name: (frame, what the ERROR says)
        "run past the pool": (packed([(2, 1), (4, 1), (6, 1), (15, 2)]), "outside the pool"),
        "run start past the pool": (packed([(2, 1), (4, 1), (6, 1), (99, 1)]), "outside the pool"),
        "uint32 wrap": (packed([(2, 1), (4, 1), (6, 1), (2 ** 32 - 1, 2)]), "outside the pool"),
        "empty run": (packed([(2, 1), (4, 0), (6, 2), (8, 1)]), "outside the pool"),
        "overlapping runs": (packed([(2, 2), (3, 1), (6, 1), (8, 1)]), "overlapping"),
        "table sum != pages": (packed(good, num=5, pages=5), "do not add up to 5 pages"),
        "payload too short": (packed(good, nbytes=8 * 4 + 2 * 4 * page_bytes - 1), "payload of"),
        "payload too long": (packed(good, nbytes=8 * 4 + 2 * 4 * page_bytes + 16), "payload of"),
        "huge num_runs": (packed(good, runs=2 ** 32 - 1), "4294967295 runs, does not fit"),
        "more runs than pages": (packed(good, runs=5), "5 runs, does not fit"),
        "zero runs": (packed(good, runs=0), "0 runs, does not fit"),
        "pages beyond the pool": (packed(good, num=17, pages=17), "17 pages in 4 runs, does not fit"),
        "layer": (packed(good, layer=2), "layer 2, "),
        "over the frame limit": (packed([(0, 16)]), "at most 8192 per frame"),
        "truncated table": (packed(good)[:tcp.HEADER.size + len(rid) + 12], None),
    }
    before = dst.clone()
    for name, (data, message) in bad_frames.items():
        reply = raw_exchange(receiver.address, data)
        if message is None:
            continue  # the peer hung up: nothing to answer
        assert len(reply) >= tcp.HEADER.size, name
        fields = tcp.HEADER.unpack(reply[:tcp.HEADER.size])
        assert fields[0] == tcp.MAGIC and fields[2] == tcp.ERROR and fields[3] == tcp.ABORTED, name
        assert message in reply[tcp.HEADER.size:].decode(), (name, reply)
    assert same_bytes(dst, before)  # nothing landed
    # A well-formed frame on the same kind of raw connection lands (the pool is still served).
    reply = raw_exchange(receiver.address, packed(good) + tcp.frame(tcp.FLUSH, rid, ep))
    assert tcp.HEADER.unpack(reply[:tcp.HEADER.size])[2] == tcp.ACK
    assert bool((dst[0, :, [2, 4, 6, 8]].contiguous().view(torch.uint8) == 7).all())
    leases.release("victim")
    transfer(receiver, src, dst, leases, "ok", *FRAGMENTED, cleanup)
    assert same_bytes(dst[:, :, FRAGMENTED[1]], src[:, :, FRAGMENTED[0]])


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
        "rid length": tcp.HEADER.pack(tcp.MAGIC, tcp.VERSION, tcp.WRITE, 0, 60000, ep, 0, 4, 2, page2),
        "version 1": tcp.HEADER.pack(tcp.MAGIC, 1, tcp.WRITE, 0, 6, ep, 0, 4, 2, page2) + rid + b"\0" * page2,
        "rid utf8": tcp.frame(tcp.WRITE, b"\xff\xfe", ep, 0, 4, 2, page2),
        "flush payload": tcp.frame(tcp.FLUSH, rid, ep, payload_len=5) + b"hello",
        "truncated": tcp.frame(tcp.WRITE, rid, ep, 0, 4, 2, page2)[:20],
        "cut payload": tcp.frame(tcp.WRITE, rid, ep, 0, 4, 2, page2) + b"\0" * 10,
        # HEADS (a head range of a run, head_map): heads past the pool's, a payload of the wrong size.
        "heads range": tcp.frame(tcp.HEADS, rid, ep, 0, 4, 2, 8 + page2) + struct.pack("!II", 1, 2) + b"\0" * page2,
        "heads length": tcp.frame(tcp.HEADS, rid, ep, 0, 4, 2, 8 + page2 // 2 + 1) + struct.pack("!II", 0, 1)
        + b"\0" * (page2 // 2 + 1),
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


@pytest.mark.parametrize("src_dtype, dst_dtype", [("int8", torch.float32), (torch.bfloat16, "fp8_e4m3"),
                                                  ("int8", "fp8_e4m3")])
def test_quantized_and_plain_pages_never_mix(cleanup, src_dtype, dst_dtype):
    dst = make_pool(1, 8, dtype=dst_dtype)
    before = dst.clone()
    receiver = receiver_for(cleanup, dst, make_leases(8))
    lease = receiver.leases.grant("r", [0])
    sender = TcpSender(receiver.address, make_pool(1, 8, dtype=src_dtype))
    cleanup(sender)
    with pytest.raises(LayoutMismatchError, match="kv_cache_dtype"):
        sender.write(descriptor("r", receiver, [0], dst, lease), 0, [(0, 0, 1)])
    assert sender.bytes_sent == 0 and same_bytes(dst, before)


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
from splitserve.kvtransfer.base import KVLayout, TransferDescriptor
from splitserve.kvtransfer.transports import tcp
from splitserve.kvtransfer.transports.tcp_sender import TcpSender
address, epoch = sys.argv[1], int(sys.argv[2])
pool = torch.randn(2, 2, 16, 8, 2, 8)
sender = TcpSender(address, pool)
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


def test_idle_connections_cannot_pile_up_threads(cleanup):
    """A thread serves each connection; past max_connections one more is closed at once, and a
    slot freed is taken again (issue 36, point 12). A real sender still gets through after."""
    import socket
    dst = make_pool(seed=1)
    leases = make_leases(dst.shape[2])
    receiver = receiver_for(cleanup, dst, leases, max_connections=3)
    host, port = receiver.address.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(3)]
    deadline = time.monotonic() + 10
    while receiver.num_connections < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    extra = socket.create_connection((host, int(port)))
    extra.settimeout(10)
    assert extra.recv(1) == b""  # closed by the receiver
    assert receiver.num_connections == 3
    for s in [extra, *idle]:
        s.close()
    while receiver.num_connections:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    src = make_pool(seed=2)
    transfer(receiver, src, dst, leases, "r", [0, 1], [5, 6], cleanup)
    assert same_bytes(dst[:, :, 5:7], src[:, :, 0:2])
