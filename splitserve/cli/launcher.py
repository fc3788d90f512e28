"""The one launcher: child processes started, watched and stopped the same way everywhere.

``splitserve up`` runs its stack through ``Supervisor``; the test harness (``tests/harness``)
starts its processes with ``spawn``; ``splitserve tune`` and the benchmarks run whole stacks
with ``UpProcess``. Every child dies with the thread that started it (Linux's parent-death
signal, ``splitserve.common.processes``), so even a ``kill -9`` of the parent leaves no orphan.

``Supervisor`` is what ``up`` needs of one, as compose's ``restart:`` or a Kubernetes
controller would be:

* **a child that dies** (crash, ``kill -9``, a failed engine step that exits 1) is started
  again with the same command after a bounded backoff (0.5 s, doubling per failure in a row,
  at most 30 s; a child that ran for a minute starts from 0.5 s again), while the others keep
  serving: the gateway retries a dead worker's requests on the others, and the new worker
  registers in Redis and takes work;
* **the gateway dying** takes its clients' open streams with it (they end with UNAVAILABLE);
  it is restarted on the same port, and new requests succeed once it is back. Requests it had
  queued are failed by the claim of any gateway once its alive key lapses (5 s), those it had
  running by the claim reaper (30 s); their workers freed the pages as soon as the gateway's
  calls broke;
* **Redis dying** (the private one ``up`` starts) makes the gateway answer UNAVAILABLE and
  NOT_SERVING; it is restarted on the same port and directory and replays its append-only file
  (fsync every second), the workers register again and the gateway serves again, by
  themselves. Requests already streaming keep streaming through the outage.

Stopping goes stage by stage (the gateway, then the workers, then Redis), each child with its
drain. What ``up`` starts, and in which order, is ``splitserve.cli.up``.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from splitserve.common.locality import remove_pools_of
from splitserve.common.processes import die_with_parent, free_port

BOOT_TIMEOUT_S = 300
# Restart backoff: first delay, cap, and how long a child must run for its backoff to reset.
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0
# How long a stopping child may drain before it is killed.
STOP_TIMEOUT_S = 15.0

# `python -m splitserve.cli`: the command every process of a stack runs.
CLI = (sys.executable, "-m", "splitserve.cli")


# ---- one child ------------------------------------------------------------------------------

@dataclass
class Process:
    """A running child: its stdout is drained on a thread (a full pipe would block it) and the
    first line holding ``ready_text`` is noted; with ``log_path`` every other line goes there."""

    proc: subprocess.Popen
    ready_text: str
    log_path: Path | None = None
    on_line: Callable[[str], None] | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    line: str = ""  # its ready line

    def _drain(self) -> None:
        sink = open(self.log_path, "a") if self.log_path else None
        try:
            for text in self.proc.stdout:
                if self.on_line is not None:
                    self.on_line(text)
                if not self.ready.is_set() and self.ready_text in text:
                    self.line = text.strip()
                    self.ready.set()
                elif sink is not None:
                    sink.write(text)
                    sink.flush()
        finally:
            self.ready.set()
            if sink is not None:
                sink.close()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path and self.log_path.exists() else ""

    def wait_ready(self, timeout_s: float = BOOT_TIMEOUT_S) -> str:
        """Its ready line; RuntimeError (after killing it) if it exits or stays silent for ``timeout_s``."""
        self.ready.wait(timeout_s)
        if not self.line:
            self.kill()
            raise RuntimeError(f"{' '.join(map(str, self.proc.args))[:300]} did not start within {timeout_s:.0f} s "
                               f"(exit code {self.proc.returncode}): {self.log_tail()}")
        return self.line

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM (it drains) and wait; SIGKILL past ``timeout_s``. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.send_signal(signal.SIGCONT)  # a frozen (SIGSTOP) child must see the SIGTERM
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return self.kill()
        remove_pools_of(self.proc.pid)
        return code

    def kill(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait(10)
        remove_pools_of(self.proc.pid)  # what a killed worker could not remove itself
        return code


def spawn(argv: Sequence[str], ready_text: str, *, env: dict[str, str] | None = None,
          log_path: Path | None = None, cwd: str | os.PathLike | None = None,
          death_signal: int = signal.SIGTERM, on_line: Callable[[str], None] | None = None) -> Process:
    """Start ``argv`` with ``env`` on top of this process's environment. Call it from a thread that
    outlives the child (the parent-death signal follows the spawning thread; it survives a prefix
    that execs, as ``ip netns exec`` does). ``log_path``: stderr and every stdout line but the
    ready one are appended there; without it stderr is this process's own."""
    stderr = open(log_path, "a") if log_path else None
    try:
        proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL,
                                text=True, cwd=cwd, env={**os.environ, **(env or {})},
                                preexec_fn=die_with_parent(death_signal))
    finally:
        if stderr is not None:
            stderr.close()
    process = Process(proc, ready_text, Path(log_path) if log_path else None, on_line)
    threading.Thread(target=process._drain, name=f"stdout-{proc.pid}", daemon=True).start()
    return process


# ---- a supervised set of children -----------------------------------------------------------

@dataclass
class ChildSpec:
    """One process ``up`` runs: its command, and the stdout line that says it is ready."""

    name: str  # redis, gateway, decode0, prefill1, both
    argv: list[str]
    ready: str
    env: dict[str, str] = field(default_factory=dict)
    slot: int = 0  # a worker's place among up's workers (its metrics port after the gateway's); 0: not a worker


@dataclass
class Child:
    spec: ChildSpec
    process: Process | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = BACKOFF_MIN_S
    due: float | None = None  # when a dead child is started again
    announced: bool = False  # its being back was said
    retiring: bool = False  # asked to stop for good (a role change): not started again when it exits

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.process.proc if self.process else None

    @property
    def line(self) -> str:
        return self.process.line if self.process else ""


class StoppedWhileStarting(Exception):
    """A stop (SIGTERM, SIGINT) came while ``up`` was still starting its processes."""


class Supervisor:
    def __init__(self, specs: list[ChildSpec], say=None):
        self.children = [Child(spec) for spec in specs]
        self.say = say or (lambda text: print(f"up: {text}", file=sys.stderr, flush=True))

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.spec.name == name)

    def _spawn(self, child: Child) -> None:
        """Start ``child`` (always from the main thread: the parent-death signal follows the
        spawning thread)."""
        child.announced = False
        child.process = spawn(child.spec.argv, child.spec.ready, env=child.spec.env)
        child.started_at = time.monotonic()

    def boot(self, names: list[str], timeout_s: float = BOOT_TIMEOUT_S, stop: threading.Event | None = None) -> None:
        """Start ``names`` together and wait until each is ready; RuntimeError if one is not,
        StoppedWhileStarting as soon as ``stop`` is set (the caller stops what was started)."""
        started = [self.child(n) for n in names]
        for child in started:
            self._spawn(child)
        give_up = time.monotonic() + timeout_s
        for child in started:
            while not child.process.ready.wait(min(0.2, max(0.0, give_up - time.monotonic()))):
                if stop is not None and stop.is_set():
                    raise StoppedWhileStarting
                if time.monotonic() >= give_up:
                    break
            if not child.line:
                raise RuntimeError(f"{child.spec.name} did not start within {timeout_s:.0f} s "
                                   f"(exit code {child.proc.poll()})")
            print(f"{child.spec.name} (pid {child.proc.pid}): {child.line}", flush=True)

    def watch(self, stop: threading.Event, poll_s: float = 0.2, tick=None) -> None:
        """Until ``stop`` is set: restart every child that dies, with its backoff; ``tick(now)``,
        if given, runs after each round (the role controller)."""
        while not stop.wait(poll_s):
            self.step()
            if tick is not None:
                tick(time.monotonic())

    def step(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.proc is None or child.retiring:
                continue
            if child.due is None and child.proc.poll() is not None:
                remove_pools_of(child.proc.pid)  # a killed decode worker's KV pool, before its successor makes one
                ran = now - child.started_at
                child.backoff_s = BACKOFF_MIN_S if ran >= STABLE_S else child.backoff_s
                child.due = now + child.backoff_s
                self.say(f"{child.spec.name} (pid {child.proc.pid}) exited with code {child.proc.returncode} "
                         f"after {ran:.1f} s; starting it again in {child.backoff_s:.1f} s")
                child.backoff_s = min(BACKOFF_MAX_S, child.backoff_s * 2)
            elif child.due is not None and now >= child.due:
                child.due = None
                child.restarts += 1
                self._spawn(child)
            elif child.due is None and child.restarts and child.line and not child.announced:
                child.announced = True
                self.say(f"{child.spec.name} is back (pid {child.proc.pid}, restart {child.restarts}): {child.line}")

    def retire(self, child: Child) -> None:
        """SIGTERM ``child`` (it drains) and let it go: ``step`` does not start it again."""
        child.retiring = True
        if child.proc is not None and child.proc.poll() is None:
            child.proc.terminate()

    def respawn(self, child: Child, spec: ChildSpec) -> None:
        """Start a retired ``child`` (exited) again as ``spec``: the same place, another process."""
        remove_pools_of(child.proc.pid)
        child.spec, child.retiring, child.restarts, child.due = spec, False, 0, None
        child.backoff_s = BACKOFF_MIN_S
        self._spawn(child)

    def names(self, exclude: tuple[str, ...] = ()) -> list[str]:
        return [c.spec.name for c in self.children if c.spec.name not in exclude]

    def stop(self, stages: list[list[str]]) -> None:
        """Stage by stage: SIGTERM the children of a stage together (each drains), SIGKILL whatever
        of them outlives ``STOP_TIMEOUT_S``, and only then the next stage, so what a draining
        child still needs (Redis, for the gateway and the workers) is there until it has gone."""
        for stage in stages:
            running = [self.child(n) for n in stage if self.child(n).proc is not None]
            for child in running:
                if child.proc.poll() is None:
                    child.proc.terminate()
            give_up = time.monotonic() + STOP_TIMEOUT_S
            for child in running:
                try:
                    child.proc.wait(timeout=max(0.1, give_up - time.monotonic()))
                    remove_pools_of(child.proc.pid)
                except subprocess.TimeoutExpired:
                    child.process.kill()


# ---- a whole `splitserve up` as one child ---------------------------------------------------

_CHILD_READY = re.compile(r"^(\S+) \(pid (\d+)\): ")
_UP_READY = re.compile(r"splitserve is up: gRPC ([^,\s]+)(?:, OpenAI HTTP (\S+)/v1)? \(Redis (\S+)\)")
_BACK = re.compile(r"up: (\S+) is back \(pid (\d+),")


class UpProcess:
    """``splitserve up <args>`` as a child process on free ports (several run side by side, so A
    and B can be interleaved in one run). ``address``/``http`` once ``wait_ready`` returned;
    ``pids`` its children by name as ``up`` announced them; ``log_path`` holds what ``up`` and
    its children printed. ``port=0`` (or ``--http-port 0`` in ``up_args``) lets ``up`` pick the
    gateway's port: ``address`` (``http``) is then the one it announces when it is up."""

    def __init__(self, name: str, up_args: Sequence[str], log_path: str | os.PathLike | None = None,
                 port: int | None = None, http: bool = True):
        self.name = name
        self.up_args = list(up_args)
        self.port = free_port() if port is None else port
        self.address = f"127.0.0.1:{self.port}"
        # Not up's default 8000: several stacks (and tests) run side by side.
        self.http_port = free_port() if http else -1
        self.http = f"http://127.0.0.1:{self.http_port}" if http else ""
        self.log_path = Path(log_path) if log_path else \
            Path(tempfile.mkstemp(prefix=f"splitserve-up-{name}-", suffix=".log")[1])
        self._own_log = log_path is None
        self.pids: dict[str, int] = {}
        self.redis_url = ""
        self.process: Process | None = None

    @property
    def command(self) -> list[str]:
        return ["splitserve", "up", *self.up_args]

    def _note(self, line: str) -> None:
        child = _CHILD_READY.match(line)
        if child:
            self.pids[child.group(1)] = int(child.group(2))
        up = _UP_READY.search(line)
        if up:
            self.port, self.redis_url = int(up.group(1).rsplit(":", 1)[1]), up.group(3)
            self.address = f"127.0.0.1:{self.port}"
            if up.group(2):  # the HTTP port up serves (picked by up where it was given 0)
                self.http_port = int(up.group(2).rsplit(":", 1)[1])
                self.http = f"http://127.0.0.1:{self.http_port}"

    def start(self) -> "UpProcess":
        self.process = spawn([*CLI, "up", "--port", str(self.port), "--http-port", str(self.http_port),
                              *self.up_args], "splitserve is up", log_path=self.log_path, on_line=self._note)
        return self

    def wait_ready(self, timeout_s: float = BOOT_TIMEOUT_S) -> "UpProcess":
        try:
            self.process.wait_ready(timeout_s)
        except RuntimeError:
            raise RuntimeError(f"stack {self.name} ({' '.join(self.command)}) did not come up "
                               f"(exit code {self.process.proc.poll()}); its log:\n{self.log_tail()}") from None
        print(f"stack {self.name} up at {self.address}: {' '.join(self.command)}", flush=True)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def wait_log(self, text: str, timeout_s: float = 120.0) -> str:
        """Until ``text`` appears in up's log; returns the line (a "X is back" line updates ``pids``).
        AssertionError after ``timeout_s``."""
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            for line in self.log().splitlines():
                if text in line:
                    back = _BACK.search(line)
                    if back:
                        self.pids[back.group(1)] = int(back.group(2))
                    return line
            time.sleep(0.1)
        raise AssertionError(f"up did not say {text!r} within {timeout_s:.0f} s; it said:\n{self.log()[-3000:]}")

    def terminate(self) -> None:
        if self.process is not None and self.process.proc.poll() is None:
            self.process.proc.terminate()

    def wait_stopped(self, timeout_s: float = 60.0) -> None:
        """Until ``up`` has drained and stopped its children (killed past ``timeout_s``: its
        children then get SIGTERM from their parent-death signal)."""
        if self.process is None:
            return
        try:
            self.process.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
        if self._own_log:
            self.log_path.unlink(missing_ok=True)

    def close(self, timeout_s: float = 60.0) -> None:
        self.terminate()
        self.wait_stopped(timeout_s)

    def __enter__(self) -> "UpProcess":
        if self.process is None:  # (one started already is not started twice)
            self.start().wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def running(stacks: Sequence[UpProcess]) -> Iterator[Sequence[UpProcess]]:
    """Start every stack side by side, wait until all are up; stop them all on exit."""
    t0 = time.monotonic()
    try:
        for stack in stacks:
            stack.start()
        for stack in stacks:
            stack.wait_ready()
        print(f"{len(stacks)} stack(s) up in {time.monotonic() - t0:.0f} s", flush=True)
        yield stacks
    finally:
        t0 = time.monotonic()
        for stack in stacks:
            stack.terminate()
        for stack in stacks:
            stack.wait_stopped()
        print(f"{len(stacks)} stack(s) stopped in {time.monotonic() - t0:.0f} s", flush=True)
