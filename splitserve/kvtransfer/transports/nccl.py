"""Point-to-point over torch.distributed: NCCL between GPU pools, gloo between CPU pools.

Pairing. A receiver (decode, rank 0) hosts a ``TCPStore``; its address is "host:store_port".
NCCL refuses two ranks on one GPU, so a CUDA receiver publishes its GPU's UUID in the store and a
sender on that same GPU (prefill and decode sharing one device) refuses to pair with
``TransportUnavailableError``: the prefill side then takes the next offer (cuda_ipc comes first).
Each sender (prefill, rank 1) takes a ticket ``n`` from the store and both sides build their
own 2-rank backend objects (``dist.ProcessGroupGloo`` / ``dist.ProcessGroupNCCL``) over a
``PrefixStore("pair<n>/...")``. The default global group is never touched, so one decode
worker serves any number of prefill peers and one prefill worker can talk to many decode
workers, each pair with its own group; tearing a pair down is dropping its group objects.

Who may pair. A ``TCPStore`` has no authentication: anyone who reaches its port may read and
write keys, and so join a pair and write pages. With a ``key`` (the workers' ``--internal-token``,
through ``Security.kv_key``) every key both sides use lives under a prefix derived from it
(``store_namespace``); the store cannot list its keys, so a peer without the token finds none of
them and cannot take a ticket the receiver would serve. The store listens on the receiver's
``host`` only (``listening_store``).

Channels. Control frames always travel over the gloo group (CPU tensors); page payloads over
the data group: the same gloo group for CPU pools, an NCCL group for CUDA pools. Every
``write``/``flush`` call is one burst: the sender rings a doorbell key in the store, then sends
its frames; the receiver waits for doorbells on the store, never inside gloo, so an idle pair
never times out, and ``close`` wakes it by ringing the bell itself. Inside a burst every wait
is bounded by ``timeout_s``; a peer that dies closes its sockets and the wait fails at once.
A peer that dies between calls leaves only a parked thread, ended by ``close``; its lease
expires as usual. A sender that failed once stays failed: make a new one.

Frames. Header = int64[8]: MAGIC, type, key, epoch, layer, dst_block, num_blocks, aux.
  NAME   registers a request id under ``key`` (per pair and (request, epoch)): aux = byte
         length, then a uint8 frame with the UTF-8 id (1..1024 bytes; never pickle).
  WRITE  one run (fewer than PACK_MIN_RUNS in the call): its K then V pages, received straight
         into ``pool[layer, 0|1, d:d+n]`` while holding ``leases.writing`` and only if every
         page still carries the epoch, else into scratch with the error kept for the flush.
         aux = 1 on the call's last run.
  PACKED many runs: aux = number of runs, then int64[runs, 2] (dst, n) and one [2, pages]
         gathered payload, received into a buffer and scattered under the same fence.
  FLUSH  answered with int64[2] (status OK/STALE/EXPIRED/ABORTED, message length) + UTF-8.
  CLOSE  the sender is done; the receiver ends the pair.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import threading
import time
from datetime import timedelta
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from splitserve.engine.attention.kv_quant import as_bytes
from splitserve.engine.tensor_parallel.ranks import listening_store
from splitserve.kvtransfer.base import (KVLayout, LayoutMismatchError, LeaseExpiredError, StaleEpochError,
                                       TransferAbortedError, TransferDescriptor, TransferError,
                                       TransportUnavailableError)
from splitserve.kvtransfer.lease import LeaseTable
from splitserve.kvtransfer.transports.base import KVReceiver, KVSender, Run

MAGIC = 0x6B76_6E63  # "kvnc"
NAME, WRITE, PACKED, FLUSH, CLOSE = 1, 2, 3, 4, 5
OK, STALE, EXPIRED, ABORTED = 0, 1, 2, 3
TAG_CTL, TAG_DATA = 1, 2
MAX_NAME = 1024
PACK_MIN_RUNS = 4  # from this many runs in one write, gather/scatter beats one message pair per run
IDLE_SLICE = timedelta(hours=1)  # store waits are re-armed; close() rings instead of waiting these out
_ERRORS = {STALE: StaleEpochError, EXPIRED: LeaseExpiredError, ABORTED: TransferAbortedError}
_CODES = {StaleEpochError: STALE, LeaseExpiredError: EXPIRED}


# Derivation label of the store's key prefix; changing it breaks mixed versions.
NAMESPACE_LABEL = b"splitserve kv-nccl store namespace v1"


def store_namespace(key: bytes | None) -> str:
    """The prefix of every store key a pair uses: '' without a key, else one that only holders of
    ``key`` can compute."""
    if key is None:
        return ""
    return "k" + hmac.new(key, NAMESPACE_LABEL, hashlib.sha256).hexdigest()[:32] + "/"


def _keyed(store: dist.Store, key: bytes | None) -> dist.Store:
    namespace = store_namespace(key)
    return dist.PrefixStore(namespace, store) if namespace else store


def _groups(store: dist.Store, n: int, rank: int, device: torch.device, timeout: timedelta):
    """(control, data) groups of pair ``n``; blocks until both ranks join (at most ``timeout``)."""
    if device.type == "cuda" and not dist.is_nccl_available():
        raise TransportUnavailableError("CUDA pool but this torch build has no NCCL")
    ctl = dist.ProcessGroupGloo(dist.PrefixStore(f"pair{n}/ctl/", store), rank, 2, timeout)
    if device.type != "cuda":
        return ctl, ctl
    return ctl, dist.ProcessGroupNCCL(dist.PrefixStore(f"pair{n}/data/", store), rank, 2, timeout)


def _drop(ctl, data) -> None:
    """Tear a pair down without waiting on the peer: abort NCCL; gloo closes its sockets when freed."""
    if data is not None and data is not ctl:
        with contextlib.suppress(RuntimeError):
            data.abort()


def gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID (the same whatever CUDA_VISIBLE_DEVICES numbers it as); "" off CUDA."""
    if device.type != "cuda":
        return ""
    return str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))


def _wait_key(store: dist.Store, key: str) -> None:
    while True:
        try:
            store.wait([key], IDLE_SLICE)
            return
        except dist.DistStoreError as e:
            if "timeout" not in str(e).lower():
                raise


def _bytes_frame(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.empty(0, dtype=torch.uint8)


class NcclReceiver(KVReceiver):
    name = "nccl"

    def __init__(self, pool: torch.Tensor, leases: LeaseTable, host: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = 30.0, advertise_host: str | None = None, key: bytes | None = None):
        """``key``: senders must hold it (see "Who may pair")."""
        super().__init__(pool, leases)
        if not self.pool.is_contiguous():  # its pages as they lie in memory (KVReceiver)
            raise ValueError("the decode pool must be contiguous: runs are received in place")
        self.host, self.timeout, self._key = host, timedelta(seconds=timeout_s), key
        self._listening = listening_store(host, port, None, self.timeout, wait_for_workers=False)
        self._port = self._listening.port
        self._store = _keyed(self._listening, key)
        self._store.set("device", gpu_uuid(pool.device))
        self._advertised = advertise_host or host  # what senders dial (the store listens on ``host``)
        self._closed, self._lock = threading.Event(), threading.Lock()
        self._bells: dict[int, str] = {}  # live pair -> the doorbell key it waits on
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []  # why pairs ended abnormally (peer died, timed out, protocol)
        self._accepter = threading.Thread(target=self._accept, name="nccl-accept", daemon=True)
        self._accepter.start()

    @property
    def address(self) -> str:
        return f"{self._advertised}:{self._port}"

    @property
    def peers(self) -> int:
        with self._lock:
            return len(self._bells)

    def _client(self) -> dist.Store:
        return _keyed(dist.TCPStore(self.host, self._port, is_master=False, timeout=self.timeout), self._key)

    def _accept(self) -> None:
        try:
            store, n = self._client(), 1
            while True:
                _wait_key(store, f"pair/{n}")
                if self._closed.is_set():
                    return
                with self._lock:
                    self._bells[n] = f"pair{n}/bell0"
                thread = threading.Thread(target=self._serve, args=(n,), name=f"nccl-pair{n}", daemon=True)
                self._threads.append(thread)
                thread.start()
                n += 1
        except Exception as e:  # the store went away: nothing more to accept
            if not self._closed.is_set():
                self.errors.append(f"accept: {e}")

    def _serve(self, n: int) -> None:
        ctl = data = None
        try:
            if self.pool.is_cuda:  # NCCL kernels of this thread go to the pool's GPU
                torch.cuda.set_device(self.pool.device)
            store = self._client()
            ctl, data = _groups(store, n, 0, self.pool.device, self.timeout)
            names: dict[int, str] = {}  # key -> request id
            errors: dict[int, TransferError] = {}  # key -> first refusal, reported at the flush
            bell = 0
            while True:
                key = f"pair{n}/bell{bell}"
                with self._lock:
                    self._bells[n] = key
                if self._closed.is_set():
                    return
                _wait_key(store, key)
                if self._closed.is_set():
                    return
                store.delete_key(key)
                bell += 1
                if not self._burst(ctl, data, names, errors):
                    return
        except Exception as e:
            self.errors.append(f"pair {n}: {type(e).__name__}: {e}")
        finally:
            _drop(ctl, data)
            del ctl, data
            with self._lock:
                self._bells.pop(n, None)

    def _burst(self, ctl, data, names: dict, errors: dict) -> bool:
        """Frames of one sender call; False once the sender said CLOSE."""
        # fp8 pages travel as bytes: gloo and CPU index_copy_ take no fp8 tensors.
        hdr, pool, wait = torch.empty(8, dtype=torch.int64), as_bytes(self.pool), self.timeout
        while True:
            ctl.recv([hdr], 1, TAG_CTL).wait(wait)
            magic, kind, key, epoch, layer, dst, num, aux = hdr.tolist()
            if magic != MAGIC:
                raise TransferAbortedError(f"bad frame header {hdr.tolist()}: the peer is not an nccl sender")
            if kind in (WRITE, PACKED) and not (0 <= layer < pool.shape[0] and 0 < num <= pool.shape[2]):
                raise TransferAbortedError(f"{num} pages of layer {layer} do not fit the pool")
            if kind == NAME:
                if not 0 < aux <= MAX_NAME:
                    raise TransferAbortedError(f"request id of {aux} bytes")
                buf = torch.empty(aux, dtype=torch.uint8)
                ctl.recv([buf], 1, TAG_CTL).wait(wait)
                names[key] = bytes(buf.numpy()).decode()
            elif kind == WRITE:  # K then V straight into the pages, under the fence
                try:
                    with self._fenced(names, key, epoch, list(range(dst, dst + num))):
                        for kv in range(2):
                            data.recv([pool[layer, kv, dst:dst + num]], 1, TAG_DATA).wait(wait)
                        if pool.is_cuda:  # wait() orders the stream only: landed before the fence is let go
                            torch.cuda.current_stream(pool.device).synchronize()
                except TransferError as e:
                    errors.setdefault(key, e)
                    scratch = pool.new_empty((num, *pool.shape[3:]))
                    for _ in range(2):  # keep the stream in step, land nothing
                        data.recv([scratch], 1, TAG_DATA).wait(wait)
                if aux:
                    return True
            elif kind == PACKED:  # run table, then [K|V, pages] gathered: scatter under the fence
                if not 0 < aux <= num:
                    raise TransferAbortedError(f"{aux} runs for {num} pages")
                table, buf = torch.empty(2 * aux, dtype=torch.int64), pool.new_empty((2, num, *pool.shape[3:]))
                ctl.recv([table], 1, TAG_CTL).wait(wait)
                data.recv([buf], 1, TAG_DATA).wait(wait)
                pages = [d + i for d, n in table.view(-1, 2).tolist() for i in range(n)]
                try:
                    if len(pages) != num:
                        raise TransferAbortedError(f"run table of {len(pages)} pages for {num} sent")
                    with self._fenced(names, key, epoch, pages):
                        pool[layer].index_copy_(1, torch.tensor(pages, device=pool.device), buf)
                        if pool.is_cuda:
                            torch.cuda.current_stream(pool.device).synchronize()
                except TransferError as e:
                    errors.setdefault(key, e)
                return True
            elif kind == FLUSH:
                error, rid = errors.pop(key, None), names.pop(key, None)
                try:
                    if error is None and rid is None:
                        raise TransferAbortedError(f"flush of unknown request key {key}")
                    if error is None:
                        self.leases.check(rid, epoch)
                except TransferError as e:
                    error = e
                code = OK if error is None else _CODES.get(type(error), ABORTED)
                msg = _bytes_frame(str(error) if error else "")
                ctl.send([torch.tensor([code, msg.numel()], dtype=torch.int64)], 1, TAG_CTL).wait(wait)
                if msg.numel():
                    ctl.send([msg], 1, TAG_CTL).wait(wait)
                return True
            elif kind == CLOSE:
                return False
            else:
                raise TransferAbortedError(f"unknown frame type {kind}")

    @contextlib.contextmanager
    def _fenced(self, names: dict, key: int, epoch: int, pages: list[int]) -> Iterator[None]:
        """Hold the lease fence, and only if every page still carries the epoch."""
        if key not in names:
            raise TransferAbortedError(f"write for unknown request key {key}")
        rid = names[key]
        if min(pages) < 0 or max(pages) >= self.pool.shape[2]:
            raise TransferAbortedError(f"request {rid!r}: pages {min(pages)}..{max(pages)} outside the pool")
        with self.leases.writing(rid, epoch):
            if not self.leases.fence.owned_by(pages, epoch):
                raise StaleEpochError(f"request {rid!r}: pages {min(pages)}..{max(pages)} no longer all belong "
                                      f"to epoch {epoch}; the decode side released them")
            yield

    def close(self) -> None:
        """Stop accepting, wake idle pairs, wait (at most ~timeout_s) for bursts in progress to end."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            bells = list(self._bells.values())
        for key in bells + [f"pair/{self._store.add('pairs', 1)}"]:
            self._store.set(key, "closed")
        deadline = time.monotonic() + self.timeout.total_seconds() + 2
        self._accepter.join(self.timeout.total_seconds())  # it starts no pair once closed
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        self._store = self._listening = None  # stops the store server; a straggler's next store call fails


class NcclSender(KVSender):
    name = "nccl"

    def __init__(self, address: str, src_pool: torch.Tensor, timeout_s: float = 30.0, key: bytes | None = None):
        """``key``: the receiver's (see "Who may pair"); with another one, or none, pairing times out."""
        super().__init__(address, src_pool)
        self.timeout = timedelta(seconds=timeout_s)
        host, _, port = address.rpartition(":")
        try:
            self._store = _keyed(dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout), key)
            mine = gpu_uuid(src_pool.device)
            if mine and self._store.get("device").decode() == mine:
                raise TransportUnavailableError(f"nccl receiver {address} is on this process's GPU ({mine}); NCCL "
                                                "cannot pair two ranks on one device (use cuda_ipc)")
            self._n = self._store.add("pairs", 1)
            self._store.set(f"pair/{self._n}", "sender")
            self._ctl, self._data = _groups(self._store, self._n, 1, src_pool.device, self.timeout)
        except (RuntimeError, ValueError) as e:
            raise TransportUnavailableError(f"cannot pair with nccl receiver {address} ({e}); is the decode "
                                            "worker up and reachable on that port?") from e
        self._lock, self._bell, self._next_key = threading.Lock(), 0, 0
        self._keys: dict[tuple[str, int], int] = {}
        self._layouts: set[KVLayout] = set()
        self._broken: str | None = None

    def _fail(self, e: Exception) -> TransferAbortedError:
        self._broken = f"{type(e).__name__}: {e}"
        _drop(self._ctl, self._data)
        self._ctl = self._data = None
        return TransferAbortedError(f"nccl peer {self.address} failed ({self._broken}); the transfer is lost, "
                                    "the decode side will abort the lease: retry with a new sender")

    def _begin(self, desc: TransferDescriptor, works: list) -> int:
        """Ring the doorbell and return the request's key, registering the id on first use."""
        if self._broken:
            raise TransferAbortedError(f"nccl sender to {self.address} is broken ({self._broken})")
        key = self._keys.get((desc.request_id, desc.epoch))
        name = _bytes_frame(desc.request_id) if key is None else None
        if name is not None and not 0 < name.numel() <= MAX_NAME:
            raise ValueError(f"request id must be 1..{MAX_NAME} UTF-8 bytes")
        self._store.set(f"pair{self._n}/bell{self._bell}", "burst")
        self._bell += 1
        if name is not None:
            key = self._keys[(desc.request_id, desc.epoch)] = self._next_key
            self._next_key += 1
            self._send(works, [MAGIC, NAME, key, desc.epoch, 0, 0, 0, name.numel()])
            works.append(self._ctl.send([name], 0, TAG_CTL))
        return key

    def _send(self, works: list, header: list[int]) -> None:
        works.append(self._ctl.send([torch.tensor(header, dtype=torch.int64)], 0, TAG_CTL))

    def write(self, desc: TransferDescriptor, layer: int, runs: Sequence[Run], heads=None) -> None:
        if heads is not None:  # whole pages only (the connector re-shards over shm, cuda_ipc or tcp)
            raise LayoutMismatchError("nccl moves whole pages: it cannot re-shard KV between differently split workers")
        if desc.layout not in self._layouts:
            self.check_layout(desc)
            self._layouts.add(desc.layout)
        if not runs:
            return
        src = as_bytes(self.src_pool[layer])  # [2, blocks, bs, H, D]; fp8 pages as bytes, as the receiver takes them
        with self._lock:
            works: list = []
            try:
                key = self._begin(desc, works)
                if len(runs) >= PACK_MIN_RUNS:  # many small runs: one gathered message, not 2 per run
                    pages = [s + i for s, _, n in runs for i in range(n)]
                    packed = src.index_select(1, torch.tensor(pages, device=src.device))
                    table = torch.tensor([[d, n] for _, d, n in runs], dtype=torch.int64).flatten()
                    self._send(works, [MAGIC, PACKED, key, desc.epoch, layer, 0, len(pages), len(runs)])
                    works += [self._ctl.send([table], 0, TAG_CTL), self._data.send([packed], 0, TAG_DATA)]
                else:
                    for i, (s, d, n) in enumerate(runs):
                        self._send(works, [MAGIC, WRITE, key, desc.epoch, layer, d, n, int(i == len(runs) - 1)])
                        works += [self._data.send([src[kv, s:s + n]], 0, TAG_DATA) for kv in range(2)]
                for work in works:
                    work.wait(self.timeout)
            except RuntimeError as e:
                raise self._fail(e) from e
            self.num_copies += len(runs)
            self.bytes_sent += 2 * sum(n for _, _, n in runs) * src[0, 0].numel() * src.element_size()

    def flush(self, desc: TransferDescriptor) -> None:
        with self._lock:
            works: list = []
            try:
                key = self._begin(desc, works)
                self._send(works, [MAGIC, FLUSH, key, desc.epoch, 0, 0, 0, 0])
                status = torch.empty(2, dtype=torch.int64)
                works.append(self._ctl.recv([status], 0, TAG_CTL))
                for work in works:
                    work.wait(self.timeout)
                code, length = status.tolist()
                msg = torch.empty(length, dtype=torch.uint8)
                if length:
                    self._ctl.recv([msg], 0, TAG_CTL).wait(self.timeout)
            except RuntimeError as e:
                raise self._fail(e) from e
            finally:
                self._keys.pop((desc.request_id, desc.epoch), None)
        if code != OK:
            raise _ERRORS.get(code, TransferAbortedError)(bytes(msg.numpy()).decode() or f"status {code}")

    def usable(self) -> bool:
        return not self._broken

    def close(self) -> None:
        """Say CLOSE (bounded by timeout_s) and drop the pair."""
        with self._lock:
            if self._ctl is not None and not self._broken:
                try:
                    self._store.set(f"pair{self._n}/bell{self._bell}", "close")
                    self._ctl.send([torch.tensor([MAGIC, CLOSE, 0, 0, 0, 0, 0, 0])], 0, TAG_CTL).wait(self.timeout)
                except RuntimeError:
                    pass
            _drop(self._ctl, self._data)
            self._ctl = self._data = None
            self._broken = self._broken or "closed"
