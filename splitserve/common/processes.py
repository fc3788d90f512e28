"""Child processes that never outlive their parent, and free ports to give them."""
from __future__ import annotations

import ctypes
import random
import signal
import socket
import sys
from pathlib import Path
from typing import Callable, Collection

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


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A TCP port nothing listens on now, for a process to bind soon: a random one just below the
    OS's ephemeral range. The ephemeral ports are what the OS hands out meanwhile, to every bind to
    port 0 and every outgoing connection on the machine, so a port picked there (as the OS's own
    pick is) can be taken by someone else before the process that was given it binds it (a worker
    loads its model first: seconds); one below the range is taken only by another such pick.
    ``avoid``: ports already picked for processes not yet listening (one ``up``'s gateway, Redis)."""
    low = _ephemeral_low()
    first = max(1024, low - 16384)
    picks = random.SystemRandom()
    for _ in range(64 if low - first >= 1024 else 0):
        port = picks.randrange(first, low)
        if port in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room below the range: the OS's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the OS's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
