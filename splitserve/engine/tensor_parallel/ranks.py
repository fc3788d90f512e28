"""Rank 0's handle on the other ranks of its worker: start them, step them, notice when one dies.

Ranks 1..N-1 are child processes (``python -m <follower module>``: ``splitserve.engine.tp_follower``,
or the program of the KV connector the worker wires in). They join
rank 0's torch.distributed group through a TCPStore rank 0 opens on a free port (no port race),
then connect back to a control socket. Each step rank 0 sends one ``StepMessage`` down
every control socket; the forward's all-reduces keep the ranks in step from there. A rank that
exits is seen three ways: a collective fails (gloo: "Connection closed by peer" within ~1 s), its
control socket breaks, or the watcher thread finds its process gone while the worker is idle;
each ends the worker (``RankDied``), which stops the other ranks.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from splitserve.engine.tensor_parallel import TP_FOLLOWER, FollowerProgram, dist_backend, messages
from splitserve.engine.tensor_parallel.all_reduce import ProcessGroupAllReduce, ShmAllReduce, create_shm_file

log = logging.getLogger(__name__)

SPEC_ENV = "SPLITSERVE_TP_SPEC"
# A collective that waits longer than this fails (a peer that hangs without dying). The
# compile warm-up is the longest wait between ranks: one rank may finish compiling far earlier.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
START_TIMEOUT_S = 600.0
WATCH_S = 0.5


class RankDied(RuntimeError):
    """A tensor-parallel rank of this worker exited; the worker cannot step any more."""


def listening_store(host: str, port: int, world: int | None, timeout, wait_for_workers: bool = True) -> dist.TCPStore:
    """A TCPStore server that listens on ``host`` only. Given a host, torch's own still listens on
    every interface, and the store has no authentication; this one is handed a socket bound to
    ``host`` (loopback for a worker's own ranks, the configured address for a KV receiver)."""
    sock = socket.create_server((host.strip("[]"), port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                backlog=128)
    try:
        store = dist.TCPStore(host, sock.getsockname()[1], world, is_master=True, timeout=timeout,
                              wait_for_workers=wait_for_workers, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the socket now
    return store


def init_group(backend: str, host: str, port: int, rank: int, world: int, store: dist.TCPStore | None = None):
    """This worker's own process group (not torch.distributed's default one: one process may hold
    two tensor-parallel engines, as a test of a prefill/decode pair does)."""
    if store is None:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, COLLECTIVE_TIMEOUT)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = COLLECTIVE_TIMEOUT
    return dist.ProcessGroupNCCL(store, rank, world, options)


def communicator(group, shm_path, rank: int, world: int, slot_bytes: int):
    """Shared memory between CPU ranks (``shm_path``), else the process group."""
    if shm_path:
        return ShmAllReduce(group, Path(shm_path), rank, world, slot_bytes)
    return ProcessGroupAllReduce(group)


def all_reduce_min(group, value: int, device: torch.device) -> int:
    tensor = torch.tensor([value], device=device)  # NCCL reduces only device tensors
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    group.allreduce([tensor], options).wait()
    return int(tensor)


class FollowerRanks:
    """``slot_bytes``: the largest all-reduce that goes through shared memory (CPU ranks)."""

    def __init__(self, config, model_dir: Path, device: torch.device, slot_bytes: int,
                 follower: FollowerProgram = TP_FOLLOWER):
        self.world = config.tensor_parallel_size
        self.follower = follower
        self._dead: str | None = None
        self._callbacks: list[Callable[[BaseException], None]] = []
        self._closing = False
        server = socket.create_server(("127.0.0.1", 0))
        store = listening_store("127.0.0.1", 0, self.world, COLLECTIVE_TIMEOUT, wait_for_workers=False)
        token = secrets.token_hex(16)
        self.shm_path = create_shm_file(self.world, slot_bytes) if device.type == "cpu" else None
        spec = {"world": self.world, "store_port": store.port, "control_port": server.getsockname()[1],
                "token": token, "config": dataclasses.asdict(config), "model_dir": str(model_dir),
                "num_threads": torch.get_num_threads(), "shm_path": str(self.shm_path or ""),
                "slot_bytes": slot_bytes}
        self.procs = [subprocess.Popen([sys.executable, "-m", follower.module],
                                       env={**os.environ, SPEC_ENV: json.dumps({**spec, "rank": rank})})
                      for rank in range(1, self.world)]
        try:
            self._join(dist_backend(device), store)
            self._socks = self._accept(server, token)
        except BaseException:
            self._kill()
            self._remove_shm()
            raise
        finally:
            server.close()
        self.all_reduce = communicator(self.group, self.shm_path, 0, self.world, slot_bytes)
        self._watcher = threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True)
        self._watcher.start()
        log.info("tensor parallel: rank 0 of %d (ranks 1..%d are pids %s)", self.world, self.world - 1,
                 ", ".join(str(p.pid) for p in self.procs))

    # ---- start -------------------------------------------------------------------------
    def _join(self, backend: str, store: dist.TCPStore) -> None:
        """Join the process group on a thread while watching the children: one that fails to
        start (a bad model, out of memory) must fail this worker now, not after a timeout."""
        failure: list[BaseException] = []

        def join() -> None:
            try:
                self.group = init_group(backend, "127.0.0.1", store.port, 0, self.world, store=store)
            except BaseException as e:  # handed to the waiting thread
                failure.append(e)
        joiner = threading.Thread(target=join, name="tp-join", daemon=True)
        joiner.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while joiner.is_alive():
            joiner.join(WATCH_S)
            self._raise_if_a_rank_exited("while starting")
            if time.monotonic() > deadline:
                raise RankDied(f"tensor-parallel ranks did not join within {START_TIMEOUT_S:.0f} s")
        if failure:
            raise failure[0]

    def _accept(self, server: socket.socket, token: str) -> dict[int, socket.socket]:
        server.settimeout(WATCH_S)
        socks: dict[int, socket.socket] = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(socks) < self.world - 1:
            try:
                conn, _ = server.accept()
            except socket.timeout:
                self._raise_if_a_rank_exited("before connecting")
                if time.monotonic() > deadline:
                    raise RankDied("tensor-parallel ranks did not connect their control sockets")
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello_token, rank = messages.recv(conn)
            if hello_token != token or rank in socks or not 0 < rank < self.world:
                conn.close()
                continue
            socks[rank] = conn
        return dict(sorted(socks.items()))

    def _raise_if_a_rank_exited(self, when: str) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                raise RankDied(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with {proc.returncode} {when}; "
                               "its log is above")

    # ---- steps -------------------------------------------------------------------------
    def broadcast(self, message: Any) -> None:
        """Send ``message`` to every other rank."""
        self.check()
        frame = messages.encode(message)
        try:
            for sock in self._socks.values():
                sock.sendall(frame)
        except OSError as e:
            raise self._died(f"a rank's control socket broke ({e})") from e

    def gather(self) -> list[Any]:
        """One reply from each other rank, in rank order."""
        try:
            return [messages.recv(sock) for sock in self._socks.values()]
        except (EOFError, OSError) as e:
            raise self._died(f"a rank stopped answering ({e})") from e

    def request(self, message: Any) -> list[Any]:
        self.broadcast(message)
        return self.gather()

    def check(self) -> None:
        if self._dead is not None:
            raise RankDied(self._dead)

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(RankDied)`` (from the watcher thread) when a rank exits on its own."""
        self._callbacks.append(callback)

    # ---- end ---------------------------------------------------------------------------
    def _died(self, reason: str) -> RankDied:
        self._dead = self._dead or reason
        return RankDied(self._dead)

    def _watch(self) -> None:
        while not self._closing:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None and not self._closing:
                    error = self._died(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with {proc.returncode}")
                    log.error("%s; this worker stops", error)
                    self.all_reduce.abort()  # an engine step waiting on the dead rank fails now
                    self._kill()
                    for callback in self._callbacks:
                        callback(error)
                    return
            time.sleep(WATCH_S)

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
        self._remove_pools()

    def _remove_pools(self) -> None:
        """What a rank killed outright leaves behind (its KV connector's pool): the program's cleanup."""
        if self.follower.cleanup is not None:
            for proc in self.procs:
                self.follower.cleanup(proc.pid)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the other ranks (a ``None`` message, then a kill past ``timeout_s``)."""
        if self._closing:
            return
        self._closing = True
        for sock in getattr(self, "_socks", {}).values():
            try:
                messages.send(sock, None)
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._remove_pools()
        self._remove_shm()

    def _remove_shm(self) -> None:
        if self.shm_path is not None:
            self.shm_path.unlink(missing_ok=True)
        for sock in getattr(self, "_socks", {}).values():
            sock.close()
