"""``splitserve up`` as a child process, for tests of the supervisor.

    with start_up(["--model", model, "--prefill", "2", "--decode", "2"], log_dir) as up:
        up.pids["decode0"]                  # its children, by name (as up prints them)
        up.redis_url                        # the Redis it started
        os.kill(up.pids["decode0"], 9)
        up.wait_log("decode0 is back")     # up's own messages (stderr) go to up.log_path
        up.client.generate(...)

Every wait is bounded; ``close()`` stops ``up`` with SIGTERM (it drains and stops its children)
and kills it if it lingers. ``up`` dies with the thread that started it (parent-death signal).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.client import Client
from splitserve.cli.launcher import die_with_parent, free_port

BOOT_TIMEOUT_S = 240.0
_READY = re.compile(r"^(\S+) \(pid (\d+)\): ")
_UP = re.compile(r"splitserve is up: .*\(Redis (\S+)\)")
_BACK = re.compile(r"up: (\S+) is back \(pid (\d+),")


@dataclass
class Up:
    proc: subprocess.Popen
    address: str
    log_path: Path
    pids: dict[str, int] = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)
    is_up: bool = False
    client: Client | None = None
    redis_url: str = ""  # of the Redis up runs (or was given)

    def _read(self) -> None:
        for line in self.proc.stdout:
            match = _READY.match(line)
            if match:
                self.pids[match.group(1)] = int(match.group(2))
            if "splitserve is up" in line:
                found = _UP.search(line)
                self.redis_url = found.group(1) if found else ""
                self.is_up = True
                self.ready.set()
        self.ready.set()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, text: str, timeout_s: float = 120.0) -> str:
        """Until ``text`` appears in up's messages; returns the line. AssertionError after ``timeout_s``."""
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

    def __enter__(self) -> "Up":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, timeout_s: float = 60.0) -> None:
        if self.client is not None:
            self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_up(args: list[str], log_dir: str | os.PathLike, port: int | None = None) -> Up:
    """``python -m splitserve.cli up <args> --port <port>``, once it says it is up."""
    port = port or free_port()
    if not any(a.startswith("--http-port") for a in args):
        args = [*args, "--http-port", "-1"]  # not up's 8000: tests must not depend on a fixed port
    log_path = Path(log_dir) / "up.log"
    root = Path(__file__).resolve().parents[2]
    with open(log_path, "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "up", *args, "--port", str(port)],
                                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True, cwd=root,
                                env={**os.environ, "PYTHONPATH": str(root)}, preexec_fn=die_with_parent)
    up = Up(proc, f"127.0.0.1:{port}", log_path)
    threading.Thread(target=up._read, name="up-stdout", daemon=True).start()
    up.ready.wait(BOOT_TIMEOUT_S)
    if not up.is_up:
        up.close()
        raise RuntimeError(f"splitserve up did not come up within {BOOT_TIMEOUT_S:.0f} s: {up.log()[-3000:]}")
    up.client = Client(up.address)
    return up
