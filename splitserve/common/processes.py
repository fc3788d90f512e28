"""Child processes that never outlive their parent, and free ports to give them."""
from __future__ import annotations

import ctypes
import signal
import socket
import sys
from typing import Callable

# Loaded here, in the parent: between fork and exec the child should make one C call, nothing more.
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when the *thread* that
    spawned it ends (Linux's parent-death signal; spawn from a thread that outlives the child).
    SIGTERM lets the child drain; SIGKILL also reaches a stopped (SIGSTOP) child. None off Linux."""
    if _libc is None:
        return None

    def preexec() -> None:
        _libc.prctl(_PR_SET_PDEATHSIG, sig)
    return preexec


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS's pick); bind it soon."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
