"""Who may write into a decode pool over tcp: a challenge-response on a shared secret, per connection.

A receiver built with a ``key`` (``splitserve.common.security.Security.kv_key``: derived from the
workers' ``--internal-token``, so an operator configures one secret) reads no page byte from a
connection before the connection has proven it holds the key. The first three frames of such a
connection (all with an empty request id and epoch 0) are:

    sender   -> receiver  HELLO      payload: sender nonce (32 random bytes)
    receiver -> sender    CHALLENGE  payload: receiver nonce (32) + HMAC(key, "receiver" | sn | rn)
    sender   -> receiver  AUTH       payload: HMAC(key, "sender" | sn | rn)

(``sn``/``rn``: the sender's and the receiver's nonce; HMAC-SHA256, compared in constant time.)

* A fresh receiver nonce per connection: an answer recorded on one connection is worthless on
  any other (no replay).
* Different labels for the two proofs: the receiver's proof can never be reflected back to it
  as a sender's answer.
* The sender checks the receiver's proof too, so a sender with a key never streams a prompt's
  KV to a listener that merely took over the address.
* Anything else first -- a WRITE, garbage, a wrong answer -- gets an ERROR and the connection
  is closed after at most one header and its small fixed payload were read.

Without a key on either side the handshake is skipped and the wire is as it always was (open:
the policy of the gRPC ports without ``--internal-token``). Keys must match: a sender with a key
refuses an open receiver and an open sender is refused by a receiver with a key, each with a
message that says to give every worker the same ``--internal-token``.

What this is not: encryption or per-frame integrity. After the handshake the stream is plain
TCP, as the workers' plaintext gRPC ports are; a network where someone can read or rewrite
packets between the workers needs TLS or a private network, not only this.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket

from splitserve.kvtransfer.transports.tcp_wire import (ABORTED, AUTH, CHALLENGE, ERROR, HEADER, HELLO, MAGIC,
                                            MAX_MESSAGE_BYTES, VERSION, ProtocolError, frame, recv_exact)

NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
_RECEIVER_LABEL = b"splitserve kv-tcp receiver\0"
_SENDER_LABEL = b"splitserve kv-tcp sender\0"
HINT = "give every decode and prefill worker the same --internal-token (SPLITSERVE_INTERNAL_TOKEN)"


class AuthRefused(Exception):
    """The peer did not prove it holds the key (or refused ours); the connection is unusable."""


def _mac(key: bytes, label: bytes, sender_nonce: bytes, receiver_nonce: bytes) -> bytes:
    return hmac.new(key, label + sender_nonce + receiver_nonce, hashlib.sha256).digest()


def _read_frame(sock: socket.socket, want: int, payload_bytes: int) -> bytes:
    """The payload of the next frame, which must be of type ``want`` with exactly ``payload_bytes``
    of payload and no request id; else ProtocolError (nothing more is read)."""
    header = bytearray(HEADER.size)
    recv_exact(sock, memoryview(header))
    magic, version, ftype, _, rid_len, _, _, _, _, nbytes = HEADER.unpack(header)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"bad frame header (magic {magic!r}, version {version})")
    if ftype == ERROR and want != ERROR and rid_len == 0 and nbytes <= MAX_MESSAGE_BYTES:
        message = bytearray(nbytes)
        recv_exact(sock, memoryview(message))
        raise AuthRefused(message.decode(errors="replace"))
    if ftype != want or rid_len != 0 or nbytes != payload_bytes:
        raise ProtocolError(f"authentication required: expected frame type {want} with {payload_bytes} bytes, "
                            f"got type {ftype} with {nbytes} bytes; {HINT}")
    payload = bytearray(payload_bytes)
    recv_exact(sock, memoryview(payload))
    return bytes(payload)


def accept(sock: socket.socket, key: bytes) -> None:
    """Receiver side: returns once the peer proved it holds ``key``; raises ProtocolError (the
    caller answers ERROR and closes) otherwise. Reads at most two fixed-size frames."""
    sender_nonce = _read_frame(sock, HELLO, NONCE_BYTES)
    receiver_nonce = os.urandom(NONCE_BYTES)
    proof = _mac(key, _RECEIVER_LABEL, sender_nonce, receiver_nonce)
    sock.sendall(frame(CHALLENGE, b"", 0, payload_len=NONCE_BYTES + MAC_BYTES) + receiver_nonce + proof)
    try:
        answer = _read_frame(sock, AUTH, MAC_BYTES)
    except AuthRefused as e:  # the sender did not accept our proof: it has another key
        raise ProtocolError(f"the sender refused this receiver's proof ({e})") from None
    if not hmac.compare_digest(answer, _mac(key, _SENDER_LABEL, sender_nonce, receiver_nonce)):
        raise ProtocolError(f"authentication failed: the sender's answer does not match this receiver's key; {HINT}")


def connect(sock: socket.socket, key: bytes) -> None:
    """Sender side: prove ``key`` to the receiver and check its proof; AuthRefused if either fails."""
    sender_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(frame(HELLO, b"", 0, payload_len=NONCE_BYTES) + sender_nonce)
    try:
        challenge = _read_frame(sock, CHALLENGE, NONCE_BYTES + MAC_BYTES)
    except ProtocolError as e:
        raise AuthRefused(f"the receiver did not answer the handshake ({e})") from None
    receiver_nonce, proof = challenge[:NONCE_BYTES], challenge[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _mac(key, _RECEIVER_LABEL, sender_nonce, receiver_nonce)):
        msg = f"the receiver's proof does not match this sender's key; {HINT}".encode()
        sock.sendall(frame(ERROR, b"", 0, payload_len=len(msg), kind=ABORTED) + msg)
        raise AuthRefused(msg.decode())
    sock.sendall(frame(AUTH, b"", 0, payload_len=MAC_BYTES) + _mac(key, _SENDER_LABEL, sender_nonce, receiver_nonce))
