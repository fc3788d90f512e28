"""``splitserve up`` as a child process, for tests of the supervisor (the launcher's ``UpProcess``
with a client on its gateway).

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
import subprocess
from pathlib import Path

from splitserve.cli.launcher import UpProcess
from splitserve.client import Client

BOOT_TIMEOUT_S = 240.0


class Up(UpProcess):
    client: Client | None = None

    @property
    def proc(self) -> subprocess.Popen:
        return self.process.proc

    def close(self, timeout_s: float = 60.0) -> None:
        if self.client is not None:
            self.client.close()
        super().close(timeout_s)


def start_up(args: list[str], log_dir: str | os.PathLike, port: int | None = None) -> Up:
    """``python -m splitserve.cli up <args> --port <port>``, once it says it is up."""
    # No OpenAI HTTP port: tests must not depend on up's fixed 8000.
    up = Up("test", args, log_path=Path(log_dir) / "up.log", port=port, http=False)
    try:
        up.start().wait_ready(BOOT_TIMEOUT_S)
    except BaseException:
        up.close()
        raise
    up.client = Client(up.address)
    return up
