"""The sending end of the tcp KV transport: page runs (or head ranges of them) framed as
``splitserve/kvtransfer/transports/tcp.py`` describes, over one connection per decode address."""
from __future__ import annotations

import socket
import struct
import threading
from typing import Sequence

import torch

from splitserve.engine.attention.page_order import token_view
from splitserve.kvtransfer.base import (LeaseExpiredError, StaleEpochError, TransferAbortedError, TransferDescriptor,
                                       TransferError, TransportUnavailableError)
from splitserve.kvtransfer.transports import tcp_auth
from splitserve.kvtransfer.transports.base import KVSender, Run
from splitserve.kvtransfer.transports.tcp_wire import (ACK, ERROR, EXPIRED, FLUSH, HEADER, HEADS, MAGIC,
                                                       MAX_MESSAGE_BYTES, MAX_RID_BYTES, PACKED, STALE, VERSION,
                                                       WRITE, PeerGone, PeerTimeout, byte_view, flat_view, frame,
                                                       page_rows, recv_exact)

PACK_MIN_RUNS = 4  # from this many runs in one write(), one gathered frame beats a frame per run
_ERROR_OF = {STALE: StaleEpochError, EXPIRED: LeaseExpiredError}


class TcpSender(KVSender):
    name = "tcp"
    reshards = True

    def __init__(self, address: str, src_pool: torch.Tensor, timeout_s: float = 10.0,
                 max_frame_bytes: int = 4 << 20, key: bytes | None = None):
        """``key``: prove it to the receiver (and check its proof) before any page; see ``tcp_auth``."""
        super().__init__(address, src_pool)
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.num_frames = 0  # WRITE and PACKED frames sent
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._flat = flat_view(self.src_pool)
        self._page_bytes = self.src_layout.page_bytes
        try:
            host, port = address.rsplit(":", 1)
            self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
        except (OSError, ValueError) as e:
            raise TransportUnavailableError(f"tcp KV receiver at {address!r} is not reachable ({e}); "
                                            "is the decode worker up and its port open from here?") from e
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if key:
            try:
                tcp_auth.connect(self.sock, key)
            except (tcp_auth.AuthRefused, PeerGone, OSError) as e:
                self.sock.close()
                raise TransportUnavailableError(f"tcp KV receiver at {address!r} refused authentication or "
                                                f"failed to authenticate itself: {e}") from e

    def write(self, desc: TransferDescriptor, layer: int, runs: Sequence[Run], heads=None) -> None:
        # The pages themselves must match; the split (tensor_parallel_size) was checked by the connector.
        if heads is not None:  # the connector checked the two workers' layouts (head_map.check_pair)
            return self._write_heads(desc, layer, runs, heads)
        self.check_layout(desc)
        rid, page_bytes = desc.request_id.encode(), self._page_bytes
        src = self.src_pool[layer]  # [2, blocks, bs, H, D]
        for s, d, n in runs:
            if s < 0 or d < 0 or n < 1 or s + n > src.shape[1]:
                raise ValueError(f"run {(s, d, n)} is outside the source pool ({src.shape[1]} pages)")
        pack = len(runs) >= PACK_MIN_RUNS  # fragmented pages: one gathered frame, not a frame per run
        per_frame = max(1, self.max_frame_bytes // (2 * page_bytes + 8 * pack))  # a table entry per page at most
        frames, room = [], 0  # each a list of (src, dst, n) run pieces of at most per_frame pages in all
        for s, d, n in runs:
            while n:
                if not room or not pack:
                    frames.append([])
                    room = per_frame
                k = min(n, room)
                frames[-1].append((s, d, k))
                s, d, n, room = s + k, d + k, n - k, room - k
        with self._lock:
            self._check_usable()
            for pieces in frames:
                k = sum(n for _, _, n in pieces)
                if pack:
                    table = b"".join(struct.pack("!II", d, n) for _, d, n in pieces)
                    idx = torch.tensor([s + i for s, _, n in pieces for i in range(n)], device=src.device)
                    bufs = [frame(PACKED, rid, desc.epoch, layer, len(pieces), k, len(table) + 2 * k * page_bytes),
                            table, byte_view(page_rows(src).index_select(1, idx).cpu())]  # K, then V
                else:
                    [(s, d, _)] = pieces
                    bufs = [frame(WRITE, rid, desc.epoch, layer, d, k, 2 * k * page_bytes),
                            *[self._pages(layer, kv, s, k) for kv in (0, 1)]]
                try:
                    self._send(bufs)
                except OSError as e:
                    self._raise_broken(f"sending {k} pages of layer {layer} (to page {pieces[0][1]}...) failed ({e})")
                self.num_copies += len(pieces)  # page runs, as in every transport; frames are counted apart
                self.num_frames += 1
                self.bytes_sent += 2 * k * page_bytes

    def _write_heads(self, desc: TransferDescriptor, layer: int, runs: Sequence[Run], heads) -> None:
        """HEADS frames: ``heads.count`` KV heads of each run, gathered here (strided in a page)."""
        rid = desc.request_id.encode()
        src = token_view(self.src_pool[layer].view(torch.uint8).unsqueeze(0), self.src_layout.page_order)[0]
        src = src.narrow(3, heads.src_start, heads.count)  # [2, blocks, bs, count, row bytes]
        page = src[0, 0].numel()  # bytes of one page's share
        per_frame = max(1, (self.max_frame_bytes - 8) // (2 * page))
        with self._lock:
            self._check_usable()
            for s, d, n in runs:
                if s < 0 or d < 0 or n < 1 or s + n > src.shape[1]:
                    raise ValueError(f"run {(s, d, n)} is outside the source pool ({src.shape[1]} pages)")
                while n:
                    k = min(n, per_frame)
                    payload = src[:, s:s + k].contiguous().cpu()
                    bufs = [frame(HEADS, rid, desc.epoch, layer, d, k, 8 + payload.numel()),
                            struct.pack("!II", heads.dst_start, heads.count), byte_view(payload)]
                    try:
                        self._send(bufs)
                    except OSError as e:
                        self._raise_broken(f"sending heads of {k} pages of layer {layer} failed ({e})")
                    self.num_copies += 1
                    self.num_frames += 1
                    self.bytes_sent += payload.numel()
                    s, d, n = s + k, d + k, n - k

    def flush(self, desc: TransferDescriptor) -> None:
        rid = desc.request_id.encode()
        with self._lock:
            self._check_usable()
            try:
                self.sock.sendall(frame(FLUSH, rid, desc.epoch))
            except OSError as e:
                self._raise_broken(f"sending FLUSH failed ({e})")
            ftype, kind, r_rid, r_epoch, message = self._read_reply()
            if ftype == ERROR and kind in _ERROR_OF and r_rid == rid and r_epoch == desc.epoch:
                raise _ERROR_OF[kind](f"tcp receiver {self.address}: {message}")
            if ftype == ERROR:
                self._raise_broken(f"the receiver refused the stream: {message}")
            if ftype != ACK or r_rid != rid or r_epoch != desc.epoch:
                self._raise_broken(f"unexpected reply (type {ftype}, request {r_rid!r}, epoch {r_epoch}) "
                                   f"to the FLUSH of {desc.request_id!r} epoch {desc.epoch}")

    def usable(self) -> bool:
        return not self._broken

    def close(self) -> None:
        self._broken = self._broken or "sender closed"
        self.sock.close()

    def _pages(self, layer: int, kv: int, start: int, num: int) -> memoryview:
        """Bytes of src_pool[layer, kv, start:start+num]: a slice of the pool itself when it is contiguous."""
        if self._flat is not None:
            offset = ((layer * 2 + kv) * self.src_pool.shape[2] + start) * self._page_bytes
            return self._flat[offset:offset + num * self._page_bytes]
        return byte_view(self.src_pool[layer, kv, start:start + num].contiguous().cpu())

    def _send(self, bufs: list) -> None:
        """Header and payload parts in one syscall when the socket takes them (small frames)."""
        sent = self.sock.sendmsg(bufs)
        for buf in bufs:
            if sent < len(buf):
                self.sock.sendall(memoryview(buf)[sent:])
            sent = max(0, sent - len(buf))

    def _check_usable(self) -> None:
        if self._broken:
            raise TransferAbortedError(f"tcp connection to {self.address} is unusable: {self._broken}; "
                                       "open a new sender and retry the transfer")

    def _raise_broken(self, why: str) -> None:
        self._broken = why
        self.sock.close()
        raise TransferAbortedError(f"tcp receiver {self.address}: {why}; the transfer did not complete")

    def _read_reply(self) -> tuple[int, int, bytes, int, str]:
        header = bytearray(HEADER.size)
        try:
            recv_exact(self.sock, memoryview(header))
            magic, version, ftype, kind, rid_len, epoch, _, _, _, nbytes = HEADER.unpack(header)
            if magic != MAGIC or version != VERSION or rid_len > MAX_RID_BYTES or nbytes > MAX_MESSAGE_BYTES:
                self._raise_broken(f"malformed reply header {bytes(header)!r}")
            body = bytearray(rid_len + nbytes)
            recv_exact(self.sock, memoryview(body))
        except PeerTimeout:
            self._broken = f"no reply within {self.timeout_s} s"
            self.sock.close()
            raise TransferError(f"tcp receiver {self.address} did not answer the FLUSH within "
                                f"{self.timeout_s} s; treat the transfer as failed") from None
        except PeerGone as e:
            self._raise_broken(str(e))
        return ftype, kind, bytes(body[:rid_len]), epoch, body[rid_len:].decode(errors="replace")
