"""Any host, no GPU interconnect: page runs streamed over one TCP connection per sender.

Wire format (network byte order; never pickle). Every frame is a fixed 37-byte header,
``HEADER = struct.Struct("!4sBBBHqIIIQ")``, then the request id, then the payload:

    magic        4s  b"SSKV"
    version      B   2 (1 had no PACKED)
    type         B   WRITE=1, FLUSH=2, PACKED=5, HEADS=9 (sender -> receiver); ACK=3, ERROR=4 (receiver -> sender);
                     HELLO=6, CHALLENGE=7, AUTH=8: the handshake of a receiver with a key (``tcp_auth``)
    error kind   B   ERROR only: STALE=1, EXPIRED=2, ABORTED=3 (else 0)
    rid length   H   bytes of the UTF-8 request id that follows the header (<= 1024)
    epoch        q   the lease's fencing token
    layer        I   WRITE, PACKED: layer of the pages
    dst_block    I   WRITE, HEADS: first destination page; PACKED: runs in the frame's table (>= 1)
    num_blocks   I   WRITE, HEADS: pages in the run (>= 1); PACKED: pages in the frame (>= runs)
    payload len  Q   bytes after the request id

A WRITE payload is the run's K pages then its V pages, raw bytes in the pool's dtype: exactly
``src_pool[layer][:, s:s+n]`` laid out as ``[2, n, block_size, kv_heads, head_dim]``, so its
length is ``2 * n * page_bytes``. A PACKED payload is a table of uint32 pairs (dst_block,
num_blocks), one per run, then the K pages then the V pages of every run in table order (the
gather ``src_pool[layer][:, idx]``): ``8 * runs + 2 * pages * page_bytes`` bytes. A ``write()``
of ``PACK_MIN_RUNS`` runs or more (fragmented pages) is sent as PACKED frames, each with its own
table, one per layer within ``max_frame_bytes``; fewer runs go as a WRITE per run. A HEADS
payload carries some KV heads of a run (the two workers split over different numbers of ranks,
``splitserve/kvtransfer/head_map.py``): uint32 (first destination head, heads), then the run's K
then V pages of those heads only, ``[2, n, block_size, heads, head_dim]``. FLUSH has no
payload; the receiver answers it with ACK (every earlier write of that request and epoch is in
the pool) or ERROR, whose payload is a UTF-8 message. Replies echo the request id and epoch. A
frame that fails validation (magic, version, type, ranges, lengths, runs that leave the pool,
overlap or miscount) gets an ERROR (kind ABORTED) and the connection is closed.

The receiver reads each half of a WRITE payload straight into the destination pool slice
(``pool[layer, k_or_v, d:d+n]`` is contiguous), holding the lease table's fence and only after
checking that the pages still carry the frame's epoch; PACKED pages land in a per-connection
scratch buffer, then are scattered (``index_copy_``) under the fence after the same check. A
refused write (stale epoch, expired or released lease) is discarded and remembered, and the next
FLUSH for that request and epoch replies ERROR. Holding the fence while receiving makes
``release()`` wait for the current frame, so senders cut writes into frames of at most
``max_frame_bytes`` (4 MiB).

A receiver with a ``key`` (the workers' ``--internal-token``, through ``Security.kv_key``) first
runs the challenge-response of ``tcp_auth`` on every connection and reads no frame of pages
before the sender has proven the key; without one, anyone who reaches the port may write.
The header layout and frame types live in ``tcp_wire``, the sender in ``tcp_sender``.
"""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import torch

from splitserve.common.locality import is_loopback
from splitserve.engine.attention.page_order import token_view
from splitserve.kvtransfer.base import KVLayout, LeaseExpiredError, StaleEpochError, TransferError
from splitserve.kvtransfer.lease import LeaseTable
from splitserve.kvtransfer.transports import tcp_auth
from splitserve.kvtransfer.transports.base import KVReceiver
from splitserve.kvtransfer.transports.tcp_wire import (ABORTED, ACK, ERROR, EXPIRED, FLUSH, HEADER, HEADS, MAGIC,
                                                       MAX_MESSAGE_BYTES, MAX_RID_BYTES, PACKED, STALE, VERSION,
                                                       WRITE, HELLO, ProtocolError, PeerGone, byte_view, flat_view,
                                                       frame, page_rows, recv_exact)

log = logging.getLogger(__name__)

_KIND_OF = {StaleEpochError: STALE, LeaseExpiredError: EXPIRED}


def _scratch(holder: list, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of a connection's reusable uint8 buffer, grown when too small."""
    if holder[0].numel() < nbytes:
        holder[0] = torch.empty(nbytes, dtype=torch.uint8)
    return holder[0][:nbytes]


class TcpReceiver(KVReceiver):
    name = "tcp"

    def __init__(self, pool: torch.Tensor, leases: LeaseTable, host: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = 10.0, max_frame_bytes: int = 64 << 20, advertise_host: str | None = None,
                 key: bytes | None = None, max_connections: int = 256):
        """Listens on ``host``; descriptors name ``advertise_host`` (default ``host``), the name
        senders reach it by (e.g. a container's service name when listening on 0.0.0.0).
        ``key``: only senders proving it may write (``tcp_auth``); None: anyone who reaches the port.
        ``max_connections``: connections served at once (a thread each; a prefill worker keeps one
        per rank); one more is closed at once, so idle connections cannot pile up threads."""
        super().__init__(pool, leases)
        self.max_connections = max_connections
        self.key = key or None
        self.timeout_s = timeout_s  # a frame that stalls this long mid-payload drops its connection
        self.max_frame_bytes = max_frame_bytes
        self.layout = KVLayout.of_pool("", pool)
        self._flat = flat_view(self.pool)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family)
        self._listener.settimeout(0.2)
        self._host, self._port = advertise_host or host, self._listener.getsockname()[1]
        if self.key is None and not is_loopback(host):
            log.warning("tcp KV receiver on %s accepts page writes from anyone who reaches it: %s",
                        self.address, tcp_auth.HINT)
        self._accept_thread = threading.Thread(target=self._accept_loop, name="tcp-kv-accept", daemon=True)
        self._accept_thread.start()

    @property
    def address(self) -> str:
        return f"[{self._host}]:{self._port}" if ":" in self._host else f"{self._host}:{self._port}"

    @property
    def num_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        self._stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() at once
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = dict(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes a handler blocked in recv
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for thread in [self._accept_thread, *conns.values()]:
            thread.join(max(0.0, deadline - time.monotonic()))
        for conn in conns:
            conn.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # listener closed
            conn.settimeout(self.timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(target=self._serve, args=(conn,), name="tcp-kv-conn", daemon=True)
            with self._lock:
                if self._stop.is_set():
                    conn.close()
                    return
                if len(self._conns) >= self.max_connections:
                    log.warning("tcp KV receiver %s refused a connection: %d are open already", self.address,
                                len(self._conns))
                    conn.close()
                    continue
                self._conns[conn] = thread
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        errors: dict[tuple[str, int], TransferError] = {}  # refused writes, reported at the next FLUSH
        scratch = [torch.empty(0, dtype=torch.uint8)]  # PACKED pages and refused payloads land here
        header = bytearray(HEADER.size)
        try:
            if self.key is not None:  # not one page byte is read from a peer that has not proven the key
                try:
                    tcp_auth.accept(conn, self.key)
                except ProtocolError as e:
                    log.warning("tcp KV receiver %s refused a connection: %s", self.address, e)
                    self._fail(conn, str(e))
                    return
            while not self._stop.is_set():
                if not recv_exact(conn, memoryview(header), idle_ok=True):
                    continue  # idle between frames
                try:
                    self._frame(conn, header, errors, scratch)
                except ProtocolError as e:
                    self._fail(conn, str(e))
                    return
        except (PeerGone, OSError):
            pass
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _frame(self, conn: socket.socket, header: bytearray, errors: dict, scratch: list) -> None:
        magic, version, ftype, _, rid_len, epoch, layer, dst, num, nbytes = HEADER.unpack(header)
        if magic != MAGIC or version != VERSION:
            raise ProtocolError(f"bad frame header (magic {magic!r}, version {version}); "
                                 f"expected {MAGIC!r} version {VERSION}")
        if rid_len > MAX_RID_BYTES:
            raise ProtocolError(f"request id of {rid_len} bytes (at most {MAX_RID_BYTES})")
        rid_buf = bytearray(rid_len)
        recv_exact(conn, memoryview(rid_buf))
        try:
            rid = rid_buf.decode()
        except UnicodeDecodeError:
            raise ProtocolError("request id is not UTF-8") from None
        if ftype == FLUSH:
            return self._flush(conn, rid_buf, rid, epoch, nbytes, errors)
        if ftype == HELLO:  # a sender with a key: both sides must have one, and the same
            raise ProtocolError(f"this receiver has no KV secret and does not authenticate; {tcp_auth.HINT}")
        if ftype == HEADS:
            return self._heads(conn, rid, epoch, layer, dst, num, nbytes, errors, scratch)
        if ftype not in (WRITE, PACKED):
            raise ProtocolError(f"unexpected frame type {ftype}")
        layers, _, blocks = self.pool.shape[:3]
        packed = ftype == PACKED  # dst is then the number of runs in the table that starts the payload
        expected = 8 * dst * packed + 2 * num * self.layout.page_bytes
        if layer >= layers or packed and not 0 < dst <= num <= blocks:
            raise ProtocolError(f"layer {layer}" + (f", {num} pages in {dst} runs," if packed else "")
                                 + f" does not fit the pool ({layers} layers, {blocks} pages)")
        if nbytes != expected or nbytes > self.max_frame_bytes:
            raise ProtocolError(f"payload of {nbytes} bytes; {num} pages of K and V" + " and their run table" * packed
                                 + f" are {expected} bytes (at most {self.max_frame_bytes} per frame)")
        runs = [(dst, num)]
        if packed:
            table = bytearray(8 * dst)
            recv_exact(conn, memoryview(table))
            runs = list(struct.iter_unpack("!II", table))
        if any(n < 1 or d + n > blocks for d, n in runs) or sum(n for _, n in runs) != num:
            raise ProtocolError(f"runs {runs[:4]}{'...' * (len(runs) > 4)} of layer {layer} are outside the pool "
                                 f"({blocks} pages) or do not add up to {num} pages")
        pages = range(dst, dst + num)
        if packed:  # received before taking the fence, scattered under it
            pages = [d + i for d, n in runs for i in range(n)]
            if len(set(pages)) != num:
                raise ProtocolError(f"the run table of layer {layer} has overlapping runs")
            buf = _scratch(scratch, nbytes - 8 * dst)
            recv_exact(conn, byte_view(buf))
        refused = (rid, epoch) in errors
        if not refused:
            try:
                with self.leases.writing(rid, epoch):
                    if not self.leases.fence.owned_by(pages, epoch):
                        raise StaleEpochError(f"request {rid!r}: pages {min(pages)}..{max(pages)} do not belong to "
                                              f"epoch {epoch}; they were released or were never reserved for it")
                    if not packed:
                        for kv in (0, 1):
                            self._recv_pages(conn, layer, kv, dst, num)
                        return
                    rows = page_rows(self.pool[layer])  # [2, blocks, ...]
                    kv = buf.view(rows.dtype).view(2, num, *rows.shape[2:]).to(self.pool.device)
                    idx = torch.tensor(pages, device=self.pool.device)
                    for half in (0, 1):
                        rows[half].index_copy_(0, idx, kv[half])
                    if self.pool.is_cuda:  # landed before the fence is let go and scratch is reused
                        torch.cuda.synchronize(self.pool.device)
            except (StaleEpochError, LeaseExpiredError) as e:
                refused = True
                if len(errors) >= 1024:
                    errors.pop(next(iter(errors)))
                errors[(rid, epoch)] = e
        if refused and not packed:  # drain the payload so the stream stays in step
            recv_exact(conn, byte_view(_scratch(scratch, nbytes)))

    def _heads(self, conn: socket.socket, rid: str, epoch: int, layer: int, dst: int, num: int, nbytes: int,
               errors: dict, scratch: list) -> None:
        """A HEADS frame: some KV heads of a run, received whole, then copied under the fence."""
        layers, _, blocks = self.pool.shape[:3]
        prefix = bytearray(8)
        recv_exact(conn, memoryview(prefix))
        first, count = struct.unpack("!II", prefix)
        heads = self.layout.num_kv_heads
        head_bytes = self.layout.page_bytes // heads
        if layer >= layers or num < 1 or dst + num > blocks or count < 1 or first + count > heads:
            raise ProtocolError(f"heads {first}..{first + count} of pages {dst}..{dst + num} of layer {layer} do "
                                f"not fit the pool ({layers} layers, {blocks} pages, {heads} KV heads)")
        if nbytes != 8 + 2 * num * count * head_bytes or nbytes > self.max_frame_bytes:
            raise ProtocolError(f"payload of {nbytes} bytes; {count} heads of {num} pages of K and V are "
                                f"{8 + 2 * num * count * head_bytes} (at most {self.max_frame_bytes} per frame)")
        buf = _scratch(scratch, nbytes - 8)
        recv_exact(conn, byte_view(buf))
        if (rid, epoch) in errors:
            return
        try:
            with self.leases.writing(rid, epoch):
                if not self.leases.fence.owned_by(range(dst, dst + num), epoch):
                    raise StaleEpochError(f"request {rid!r}: pages {dst}..{dst + num - 1} do not belong to epoch "
                                          f"{epoch}; they were released or were never reserved for it")
                pages = token_view(self.pool[layer].view(torch.uint8).unsqueeze(0), self.layout.page_order)[0]
                target = pages[:, dst:dst + num].narrow(3, first, count)  # [2, n, bs, count, row bytes]
                target.copy_(buf.view(2, num, target.shape[2], count, -1).to(self.pool.device))
                if self.pool.is_cuda:
                    torch.cuda.synchronize(self.pool.device)
        except (StaleEpochError, LeaseExpiredError) as e:
            if len(errors) >= 1024:
                errors.pop(next(iter(errors)))
            errors[(rid, epoch)] = e

    def _flush(self, conn: socket.socket, rid_buf: bytearray, rid: str, epoch: int, nbytes: int, errors: dict) -> None:
        if nbytes:
            raise ProtocolError(f"FLUSH with a {nbytes}-byte payload")
        err = errors.pop((rid, epoch), None)
        if err is None:
            try:
                self.leases.check(rid, epoch)
            except (StaleEpochError, LeaseExpiredError) as e:
                err = e
        if err is None:
            conn.sendall(frame(ACK, rid_buf, epoch))
        else:
            msg, kind = str(err).encode()[:MAX_MESSAGE_BYTES], _KIND_OF.get(type(err), ABORTED)
            conn.sendall(frame(ERROR, rid_buf, epoch, payload_len=len(msg), kind=kind) + msg)

    def _recv_pages(self, conn: socket.socket, layer: int, kv: int, dst: int, num: int) -> None:
        if self._flat is not None:  # zero-copy: socket -> the bytes of pool[layer, kv, dst:dst+num]
            start = ((layer * 2 + kv) * self.pool.shape[2] + dst) * self.layout.page_bytes
            recv_exact(conn, self._flat[start:start + num * self.layout.page_bytes])
            return
        target = self.pool[layer, kv, dst:dst + num]
        staging = torch.empty(target.shape, dtype=target.dtype)  # strided or device pool
        recv_exact(conn, byte_view(staging))
        target.copy_(staging)
        if target.is_cuda:  # landed before the fence is let go (a copy from pageable memory may not have)
            torch.cuda.current_stream(target.device).synchronize()

    def _fail(self, conn: socket.socket, message: str) -> None:
        """Send ERROR, then close gracefully so the peer can still read it."""
        msg = message.encode()[:MAX_MESSAGE_BYTES]
        try:
            conn.sendall(frame(ERROR, b"", 0, payload_len=len(msg), kind=ABORTED) + msg)
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(0.2)
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and not self._stop.is_set() and conn.recv(1 << 16):
                pass
        except OSError:
            pass
