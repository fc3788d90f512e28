"""tcp KV transport with a key: only senders that prove it write a page (real sockets on loopback).

Every refused peer below aims a well-formed WRITE of a marker pattern at pages it holds a live
lease for, so the only thing stopping it is the authentication: afterwards the whole pool must
be bit for bit what it was, and no page may hold a byte of the marker.
"""
from __future__ import annotations

import hashlib
import hmac
import socket
import time

import pytest
import torch

from splitserve.kvtransfer.base import (KVLayout, TransferAbortedError, TransferDescriptor, TransportUnavailableError,
                             coalesce)
from splitserve.kvtransfer.lease import LeaseTable, PageFence
from splitserve.kvtransfer.transports import tcp, tcp_auth
from splitserve.kvtransfer.transports.tcp import TcpReceiver
from splitserve.kvtransfer.transports.tcp_sender import TcpSender
from splitserve.common.security import Security

KEY = Security(token="the-internal-token").kv_key
OTHER_KEY = Security(token="another-token").kv_key
LAYERS, BLOCKS, BS, H, D = 2, 16, 8, 2, 8
MARKER = 0x5A  # the byte every hostile payload is made of


def make_pool(seed):
    torch.manual_seed(seed)
    return torch.randn(LAYERS, 2, BLOCKS, BS, H, D)


@pytest.fixture
def victim():
    """A keyed receiver over a pool with a live lease on pages 4 and 5 (epoch in ``lease``)."""
    pool = make_pool(1)
    leases = LeaseTable(PageFence(torch.empty(BLOCKS, dtype=torch.int64)), ttl_s=60.0)
    receiver = TcpReceiver(pool, leases, key=KEY)
    lease = leases.grant("victim", [4, 5])
    yield receiver, pool, pool.clone(), leases, lease
    receiver.close()


def untouched(pool, before):
    same = torch.equal(pool.view(torch.uint8), before.view(torch.uint8))
    marker_pages = (pool.view(torch.uint8).reshape(LAYERS, 2, BLOCKS, -1) == MARKER).all(-1).any()
    return same and not bool(marker_pages)


def hostile_write(rid, epoch, layer=0, dst=4, num=2):
    nbytes = 2 * num * KVLayout.of_pool("m", make_pool(0)).page_bytes
    return tcp.frame(tcp.WRITE, rid.encode(), epoch, layer, dst, num, nbytes) + bytes([MARKER]) * nbytes


def connect(receiver):
    host, port = receiver.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def read_to_end(sock):
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except OSError:  # reset: the receiver closed with our unread bytes in its buffer
        pass
    return out


def frames_of(data):
    """(type, payload) of every whole frame in ``data``."""
    out = []
    while len(data) >= tcp.HEADER.size:
        fields = tcp.HEADER.unpack(data[:tcp.HEADER.size])
        end = tcp.HEADER.size + fields[4] + fields[9]
        out.append((fields[2], data[tcp.HEADER.size + fields[4]:end]))
        data = data[end:]
    return out


def assert_refused(reply):
    kinds = [t for t, _ in frames_of(reply)]
    assert kinds and kinds[-1] == tcp.ERROR, kinds
    assert tcp.ACK not in kinds


def handshake_by_hand(sock, key, sender_nonce):
    """HELLO, read the CHALLENGE; returns (receiver nonce, receiver proof, our answer for ``key``)."""
    sock.sendall(tcp.frame(tcp_auth.HELLO, b"", 0, payload_len=len(sender_nonce)) + sender_nonce)
    header = sock.recv(tcp.HEADER.size, socket.MSG_WAITALL)
    assert tcp.HEADER.unpack(header)[2] == tcp_auth.CHALLENGE
    body = sock.recv(64, socket.MSG_WAITALL)
    receiver_nonce, proof = body[:32], body[32:]
    answer = hmac.new(key, b"splitserve kv-tcp sender\0" + sender_nonce + receiver_nonce, hashlib.sha256).digest()
    return receiver_nonce, proof, answer


def answer_then_write(receiver, lease, nonce, choose):
    """A connection that says HELLO, answers the CHALLENGE with ``choose(receiver proof, answer
    under OTHER_KEY)``, then sends a hostile WRITE and a FLUSH; returns all the receiver said."""
    with connect(receiver) as s:
        _, proof, answer = handshake_by_hand(s, OTHER_KEY, nonce)
        chosen = choose(proof, answer)
        s.sendall(tcp.frame(tcp_auth.AUTH, b"", 0, payload_len=len(chosen)) + chosen)
        s.sendall(hostile_write("victim", lease.epoch) + tcp.frame(tcp.FLUSH, b"victim", lease.epoch))
        s.shutdown(socket.SHUT_WR)
        return read_to_end(s)


def authenticated_transfer(receiver, pool, leases, rid, dst_blocks, key=KEY):
    src = make_pool(7)
    lease = leases.grant(rid, dst_blocks)
    desc = TransferDescriptor(rid, "tcp", receiver.address, tuple(dst_blocks), KVLayout.of_pool("m", pool),
                              lease.epoch, lease.deadline)
    sender = TcpSender(receiver.address, src, key=key)
    try:
        runs = coalesce([0, 1, 2], dst_blocks)
        for layer in range(LAYERS):
            sender.write(desc, layer, runs)
        sender.flush(desc)
    finally:
        sender.close()
    return src


def test_the_authenticated_path_transfers_exactly(victim):
    receiver, pool, before, leases, _ = victim
    src = authenticated_transfer(receiver, pool, leases, "ok", [9, 10, 11])
    assert torch.equal(pool[:, :, 9:12].view(torch.uint8), src[:, :, 0:3].view(torch.uint8))
    others = [b for b in range(BLOCKS) if b not in (9, 10, 11)]
    assert torch.equal(pool[:, :, others].view(torch.uint8), before[:, :, others].view(torch.uint8))


def test_a_raw_writer_without_the_handshake_is_refused(victim):
    receiver, pool, before, _, lease = victim
    with connect(receiver) as s:
        s.sendall(hostile_write("victim", lease.epoch) + tcp.frame(tcp.FLUSH, b"victim", lease.epoch))
        s.shutdown(socket.SHUT_WR)
        reply = read_to_end(s)
    assert_refused(reply)
    assert b"authentication required" in frames_of(reply)[-1][1]
    assert untouched(pool, before)


def test_a_wrong_answer_and_a_sender_with_another_key_are_refused(victim):
    receiver, pool, before, _, lease = victim
    reply = answer_then_write(receiver, lease, b"n" * 32, lambda proof, answer: answer)
    assert_refused(reply)
    assert b"authentication failed" in frames_of(reply)[-1][1]
    # The real sender with the other key notices the receiver's proof does not match, and says so.
    with pytest.raises(TransportUnavailableError, match="internal-token"):
        TcpSender(receiver.address, make_pool(3), key=OTHER_KEY)
    assert untouched(pool, before)


def test_an_answer_replayed_from_another_connection_is_refused(victim):
    receiver, pool, before, _, lease = victim
    nonce = b"s" * 32
    with connect(receiver) as first:  # a genuine exchange the attacker recorded
        _, _, recorded = handshake_by_hand(first, KEY, nonce)
    # Same HELLO on a new connection, but the receiver picks a fresh nonce.
    assert_refused(answer_then_write(receiver, lease, nonce, lambda proof, answer: recorded))
    assert untouched(pool, before)


def test_the_receivers_own_proof_reflected_back_is_refused(victim):
    receiver, pool, before, _, lease = victim
    # A valid MAC under the key, but the receiver's, not a sender's.
    assert_refused(answer_then_write(receiver, lease, b"r" * 32, lambda proof, answer: proof))
    assert untouched(pool, before)


def test_a_sender_without_a_key_is_refused_at_its_flush(victim):
    receiver, pool, before, _, lease = victim
    sender = TcpSender(receiver.address, make_pool(3))
    desc = TransferDescriptor("victim", "tcp", receiver.address, (4, 5), KVLayout.of_pool("m", pool),
                              lease.epoch, lease.deadline)
    try:
        sender.write(desc, 0, [(0, 4, 2)])
        with pytest.raises(TransferAbortedError, match="authentication required"):
            sender.flush(desc)
    finally:
        sender.close()
    assert untouched(pool, before)


def test_after_refusals_the_receiver_still_serves_and_holds_no_stray_connection(victim):
    receiver, pool, _, leases, lease = victim
    for _ in range(3):
        with connect(receiver) as s:
            s.sendall(hostile_write("victim", lease.epoch))
            s.shutdown(socket.SHUT_WR)
            read_to_end(s)
    src = authenticated_transfer(receiver, pool, leases, "after", [12, 13, 14])
    assert torch.equal(pool[:, :, 12:15].view(torch.uint8), src[:, :, 0:3].view(torch.uint8))
    deadline = time.monotonic() + 5
    while receiver.num_connections and time.monotonic() < deadline:
        time.sleep(0.02)
    assert receiver.num_connections == 0


def test_keys_must_match_on_both_sides():
    pool = make_pool(1)
    leases = LeaseTable(PageFence(torch.empty(BLOCKS, dtype=torch.int64)), ttl_s=60.0)
    open_receiver = TcpReceiver(pool, leases)
    try:  # a sender with a key never streams KV to a receiver that cannot prove the key
        with pytest.raises(TransportUnavailableError, match="no KV secret"):
            TcpSender(open_receiver.address, make_pool(3), key=KEY)
        # Without a key on either side the wire is open, as the gRPC ports without a token are.
        src = authenticated_transfer(open_receiver, pool, leases, "open", [1, 2, 3], key=None)
        assert torch.equal(pool[:, :, 1:4].view(torch.uint8), src[:, :, 0:3].view(torch.uint8))
    finally:
        open_receiver.close()


def test_the_kv_key_comes_from_the_internal_token_and_is_not_it():
    assert Security().kv_key is None
    assert Security(token="t").kv_key == Security(token="t").kv_key != Security(token="u").kv_key
    assert b"t" != Security(token="t").kv_key and len(Security(token="t").kv_key) == 32


def test_an_open_receiver_beyond_loopback_says_so(caplog):
    pool = make_pool(1)
    leases = LeaseTable(PageFence(torch.empty(BLOCKS, dtype=torch.int64)), ttl_s=60.0)
    for host, key, warned in (("127.0.0.1", None, False), ("0.0.0.0", KEY, False), ("0.0.0.0", None, True)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="splitserve.kvtransfer.transports.tcp"):
            TcpReceiver(pool, leases, host=host, key=key).close()
        assert ("accepts page writes from anyone" in caplog.text) == warned, (host, key)
