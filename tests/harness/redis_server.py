"""A private, throw-away redis-server for tests.

    with RedisServer(appendonly=True) as server:
        client = server.client()
        ...
        server.restart()   # same port and dir: the append-only file is replayed

Each server binds 127.0.0.1 on a free port, keeps its files in its own temporary directory
(removed by ``close()``/``__exit__``), never writes RDB snapshots, and dies with the process
that started it (Linux parent-death signal), so a killed test run leaves no server behind.
That signal follows the starting *thread*: start servers from a thread that outlives them
(pytest fixtures run on the main thread). Every wait is bounded.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from splitserve.common.processes import die_with_parent, free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
_live: "weakref.WeakSet[RedisServer]" = weakref.WeakSet()


class RedisServer:
    """A redis-server child process. ``start()`` (or ``with``) brings it up and waits until
    it answers PING and has finished loading; ``stop()``/``kill()``/``restart()`` manage it;
    ``close()`` also removes its directory."""

    def __init__(self, *, appendonly: bool = False, password: str | None = None, port: int | None = None,
                 dir: str | os.PathLike | None = None, appendfsync: str = "everysec",
                 extra_args: tuple[str, ...] = (), startup_timeout_s: float = 10.0, host: str = "127.0.0.1",
                 wrap: tuple[str, ...] = ()):
        """``host``: the address it binds and clients dial; ``wrap``: an argv prefix that runs it
        elsewhere, e.g. inside a network namespace (``tests.harness.netns``)."""
        self.host = host
        self.wrap = tuple(wrap)
        self.appendonly = appendonly
        self.password = password
        self.appendfsync = appendfsync
        self.extra_args = tuple(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self._fixed_port = port
        self.port: int = port or 0
        self._own_dir = dir is None
        self.dir = Path(tempfile.mkdtemp(prefix="ss-redis-") if dir is None else dir)
        self.proc: subprocess.Popen | None = None

    # ---- addresses and clients

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.dir / "redis.log"

    def client(self, **kwargs) -> redis.Redis:
        """A new client (decoded responses, 2 s timeouts, one retry so a restart is survived)."""
        opts = dict(host=self.host, port=self.port, password=self.password, decode_responses=True,
                    socket_timeout=2, socket_connect_timeout=2,
                    retry=Retry(NoBackoff(), retries=1))
        opts.update(kwargs)
        return redis.Redis(**opts)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ---- lifecycle

    def start(self) -> "RedisServer":
        if self.running():
            return self
        # A fresh free port may be taken between probing and binding: try a few.
        attempts = 1 if (self._fixed_port or self.port) else 5
        for attempt in range(attempts):
            if not self.port:
                self.port = free_port()
            try:
                self._spawn_and_wait()
                _live.add(self)
                return self
            except _PortInUse:
                if attempt == attempts - 1:
                    raise RuntimeError(f"redis-server could not bind port {self.port}: {self._log_tail()}")
                self.port = 0
        raise AssertionError("unreachable")

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (Redis flushes its append-only file and exits), SIGKILL if it takes longer."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: a crash. Writes Redis already handed to the OS are kept (AOF everysec)."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait(5.0)
        self.proc = None

    def restart(self) -> "RedisServer":
        """Stop if running, start again on the same port and dir (the AOF is replayed)."""
        self.stop()
        return self.start()

    def close(self) -> None:
        self.stop()
        _live.discard(self)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RedisServer(port={self.port}, appendonly={self.appendonly}, running={self.running()})"

    # ---- internals

    def _args(self) -> list[str]:
        args = [*self.wrap, REDIS_SERVER, "--port", str(self.port), "--bind", self.host, "--save", "",
                "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", self.appendfsync,
                "--dir", str(self.dir), "--logfile", str(self.log_path), "--loglevel", "warning",
                "--daemonize", "no", "--protected-mode", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        return args + list(self.extra_args)

    def _spawn_and_wait(self) -> None:
        self.log_path.unlink(missing_ok=True)
        self.proc = subprocess.Popen(self._args(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL,
                                     preexec_fn=die_with_parent(signal.SIGKILL))
        probe = redis.Redis(host=self.host, port=self.port, password=self.password, socket_timeout=0.5,
                            socket_connect_timeout=0.5, retry=Retry(NoBackoff(), retries=0))
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    self.proc = None
                    log = self._log_tail()
                    if "Address already in use" in log:
                        raise _PortInUse()
                    raise RuntimeError(f"redis-server exited at start: {log}")
                try:
                    if probe.ping() and probe.info("persistence").get("loading", 0) == 0:
                        return
                except redis.exceptions.BusyLoadingError:
                    pass
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer PING within "
                                       f"{self.startup_timeout_s} s: {self._log_tail()}")
                time.sleep(0.01)
        finally:
            probe.close()

    def _log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:].strip()
        except OSError:
            return "(no log)"


class _PortInUse(Exception):
    pass


@atexit.register
def _stop_all() -> None:
    for server in list(_live):
        try:
            server.kill()
            if server._own_dir:
                shutil.rmtree(server.dir, ignore_errors=True)
        except Exception:
            pass
