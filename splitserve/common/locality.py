"""Where a worker's pages live, and what moving KV between two workers costs (issue 18 part 2).

Each worker registers a ``host_id`` (in its heartbeat stats). Two workers with the same id can
use the same-host transports (``shm``: CPU pools in shared memory; ``cuda_ipc``); any two can
use the network ones (``nccl``, ``tcp``). The default id names the *shared-memory domain*: the
boot id (one kernel) plus the device and inode of the directory shm pools live in. Processes
that see the same directory can map each other's pools; a container or namespace with its own
/dev/shm gets another id, even on the same machine, and that is right, since shm cannot cross it.
``--host-id`` overrides it (say, where that directory differs but is shared anyway).

``transfer_cost`` turns the best transport a pair has in common into a penalty in units of load
(requests in flight), so placement can weigh "a faster path" against "a less busy worker".
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

# Transports usable only between workers of one host.
SAME_HOST = frozenset({"shm", "cuda_ipc"})
# Penalty of each transport, in requests in flight: a same-host copy is free; a network hop costs
# about one queued request (the KV of a prompt crosses the wire before the first token), so a
# pair on one host wins over a pair across hosts unless that one is more than a request busier.
TRANSFER_PENALTY = {"cuda_ipc": 0.0, "shm": 0.0, "nccl": 0.5, "tcp": 1.0}
# Cost of a pair with no transport in common: never chosen while any usable pair exists.
UNREACHABLE = 1e6


# A decode pool in shared memory is a directory named for the process that made it:
# <shm root>/splitserve-kv-<pid>-<random>.
POOL_PREFIX = "splitserve-kv-"


def shm_root() -> Path:
    """The shared-memory directory: $SPLITSERVE_SHM_DIR, else /dev/shm."""
    return Path(os.environ.get("SPLITSERVE_SHM_DIR", "/dev/shm"))


def pool_root() -> Path:
    """Where shm pools are made: the shared-memory directory, or the temporary one where there is none."""
    root = shm_root()
    return root if root.is_dir() else Path(tempfile.gettempdir())


def remove_pools_of(pid: int) -> None:
    """Remove the shm pools a process that has exited left behind. A worker removes its own when
    it stops; one killed outright cannot, and its pool (the whole KV cache) would stay in memory
    until reboot. Call it only for a pid this process has reaped (so no live process has it)."""
    for directory in pool_root().glob(f"{POOL_PREFIX}{pid}-*"):
        shutil.rmtree(directory, ignore_errors=True)


def is_loopback(host: str) -> bool:
    """Only this machine can reach a listener on ``host``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def pid_namespace() -> str:
    """This process's pid namespace (``pid:[<inode>]``), or "" where /proc does not say: a pid
    names a process only within its namespace."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_dead_pools() -> list[Path]:
    """Remove the shm pools of processes that are gone (killed with nobody to reap them, or
    before a reboot of the container): only this user's pools made in this pid namespace (a
    pool's ``meta.json`` says which), whose process no longer exists. Returns what it removed."""
    namespace, removed = pid_namespace(), []
    if not namespace:
        return removed
    for directory in pool_root().glob(f"{POOL_PREFIX}*"):
        try:
            pid = int(directory.name[len(POOL_PREFIX):].split("-")[0])
            if directory.lstat().st_uid != os.geteuid() or not directory.is_dir() or directory.is_symlink():
                continue
            meta = json.loads((directory / "meta.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and meta.get("pid_namespace") == namespace and not _alive(pid):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


def default_host_id(directory: str | os.PathLike | None = None) -> str:
    """This process's shared-memory domain: boot id + device and inode of the shm directory."""
    root = Path(directory) if directory else shm_root()
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = os.uname().nodename
    try:
        st = os.stat(root)
        where = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        where = "no-shm"
    return hashlib.sha256(f"{boot}|{where}".encode()).hexdigest()[:16]


def best_transport(sender: Sequence[str], sender_host: str, offers: Sequence[str], receiver_host: str) -> str | None:
    """The first of the receiver's ``offers`` (fastest first) that the sender enables and can
    reach: a same-host transport only when both name the same (non-empty) host id."""
    same_host = bool(sender_host) and sender_host == receiver_host
    for transport in offers:
        if transport in sender and (same_host or transport not in SAME_HOST):
            return transport
    return None


def transfer_cost(sender: Sequence[str], sender_host: str, offers: Sequence[str], receiver_host: str) -> float:
    """Penalty (in requests of load) of moving KV over the best common transport."""
    transport = best_transport(sender, sender_host, offers, receiver_host)
    return UNREACHABLE if transport is None else TRANSFER_PENALTY.get(transport, 1.0)
