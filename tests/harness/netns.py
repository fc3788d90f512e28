"""Several "hosts" on one Linux machine: a network namespace each, joined by a bridge.

    with Network.create() as net:                 # skips nothing itself: see ``unavailable()``
        redis = net.add_host("redis")              # Host(name, namespace, address="10.77.0.2", ...)
        decode = net.add_host("decode")
        argv = [*decode.prefix, "python", "-m", "splitserve.cli", "decode", "--host", decode.address]
        net.link_down(decode)                      # a partition: its cable pulled at the switch
        net.shape(prefill, to=decode, rate_mbit=2)  # a bandwidth cap on that path only (htb)

Topology: the bridge ``br0`` lives in a namespace of its own; every host namespace has one
veth (``eth0``, ``10.77.0.<n>/24``) whose peer is a port of that bridge. The namespace the
tests run in joins the bridge the same way (``10.77.0.1``), so a test's client reaches the
gateway, the workers and Redis as a client on another machine would; that adds one on-link
route for the subnet in this namespace and nothing else (no default route, no iptables).

A host's ``prefix`` runs a command inside its namespace (``ip netns exec``) with ``/dev/shm``
replaced by a directory of that host's own (``/dev/shm/<prefix>-<name>`` bind-mounted over it,
in the mount namespace ``ip netns exec`` makes anyway): processes of one host share it, as on a
real machine, and separate hosts share nothing, so a decode worker's ``shm`` offer is unusable
from another host and KV has to cross the network, as it would between real machines.

Names carry a per-run prefix (``ssn<pid hex>``) so parallel or crashed runs do not collide;
``cleanup_stale()`` removes what a killed run of this machine left behind. Must run as root.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

__all__ = ["Network", "Host", "unavailable", "netem_available", "cleanup_stale", "PREFIX_ROOT"]

PREFIX_ROOT = "ssn"  # every namespace and link this module makes starts with it
BRIDGE = "br0"
SHM = "/dev/shm"
# The host's directory over /dev/shm, then the command: only this process tree sees that mount.
_HOST_SHM = 'mount --bind "$0" /dev/shm && exec "$@"'


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30)


def _tc(ns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "tc", *args], check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a skip reason), or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command (iproute2) is missing"
    probe = f"{PREFIX_ROOT}probe{os.getpid():x}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (delay); htb and u32 (the rate cap) are far more common."""
    probe = f"{PREFIX_ROOT}probe{os.getpid():x}"
    if _ip("netns", "add", probe, check=False).returncode != 0:
        return False
    try:
        made = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                               "delay", "1ms"], capture_output=True, timeout=30)
        return made.returncode == 0
    finally:
        _ip("netns", "del", probe, check=False)


def cleanup_stale() -> None:
    """Remove namespaces and root-side links of this module whose creating process is gone."""
    listed = _ip("netns", "list", check=False).stdout.split()
    links = _ip("-o", "link", "show", check=False).stdout
    for name in {n for n in listed if n.startswith(PREFIX_ROOT)} | _root_links(links):
        owner = name[len(PREFIX_ROOT):].split("-")[0].rstrip("r")
        try:
            os.kill(int(owner, 16), 0)
            continue  # its run is still alive
        except (ValueError, ProcessLookupError):
            pass
        except PermissionError:
            continue
        if name in listed:
            _ip("netns", "del", name, check=False)
            shutil.rmtree(os.path.join(SHM, name), ignore_errors=True)
        else:
            _ip("link", "del", name, check=False)


def _root_links(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(PREFIX_ROOT):
                names.add(name)
    return names


@dataclass
class Host:
    name: str                 # the test's name for it ("decode0")
    namespace: str            # its network namespace
    address: str              # its IPv4 address on the bridge
    port: str                 # its veth peer on the bridge (in the bridge namespace)
    prefix: list[str] = field(default_factory=list)  # argv prefix that runs a command on this host


@dataclass
class Network:
    prefix: str               # of every name this network made
    subnet: str               # first three octets, e.g. "10.77.0"
    hosts: dict[str, Host] = field(default_factory=dict)
    _next: int = 2            # .1 is this namespace's leg

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}-br"

    @property
    def root_link(self) -> str:
        return f"{self.prefix}r"

    @classmethod
    def create(cls, subnet: str = "10.77.0") -> "Network":
        """The bridge namespace and this namespace's leg (``<subnet>.1``); raises if the subnet is
        already routed here (it would shadow a real network)."""
        routes = _ip("-4", "route", "show", f"{subnet}.0/24", check=False).stdout.strip()
        if routes:
            raise RuntimeError(f"{subnet}.0/24 is already routed here ({routes}); pick another subnet")
        net = cls(prefix=f"{PREFIX_ROOT}{os.getpid():x}", subnet=subnet)
        try:
            _ip("netns", "add", net.bridge_ns)
            _ip("link", "add", BRIDGE, "type", "bridge", ns=net.bridge_ns)
            _ip("link", "set", BRIDGE, "up", ns=net.bridge_ns)
            _ip("link", "add", net.root_link, "type", "veth", "peer", "name", "rootp", "netns", net.bridge_ns)
            _ip("link", "set", "rootp", "master", BRIDGE, "up", ns=net.bridge_ns)
            _ip("addr", "add", f"{subnet}.1/24", "dev", net.root_link)
            _ip("link", "set", net.root_link, "up")
        except BaseException:
            net.close()
            raise
        return net

    def add_host(self, name: str) -> Host:
        """A new namespace with ``lo`` and ``eth0`` (the next free address), cabled to the bridge."""
        number = self._next
        self._next += 1
        ns, port = f"{self.prefix}-{name}", f"p{number}"
        shm = os.path.join(SHM, ns)
        host = Host(name, ns, f"{self.subnet}.{number}", port, ["ip", "netns", "exec", ns, "sh", "-c", _HOST_SHM, shm])
        self.hosts[name] = host
        os.makedirs(shm, mode=0o1777, exist_ok=True)
        _ip("netns", "add", ns)
        _ip("link", "set", "lo", "up", ns=ns)
        _ip("link", "add", port, "netns", self.bridge_ns, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("addr", "add", f"{host.address}/24", "dev", "eth0", ns=ns)
        _ip("link", "set", "eth0", "up", ns=ns)
        _ip("link", "set", port, "master", BRIDGE, "up", ns=self.bridge_ns)
        return host

    # ---- faults

    def link_down(self, host: Host) -> None:
        """Pull the host's cable at the bridge: its packets go nowhere and nobody hears a reset."""
        _ip("link", "set", host.port, "down", ns=self.bridge_ns)

    def link_up(self, host: Host) -> None:
        _ip("link", "set", host.port, "up", ns=self.bridge_ns)

    def shape(self, src: Host, to: Host | list[Host], rate_mbit: float, delay_ms: float = 0.0) -> None:
        """A bandwidth cap (and, where the kernel has netem, a delay) on packets from ``src`` to
        ``to`` (a host or several, sharing the cap) only: an htb root whose default class is unlimited and whose capped class takes
        just the packets a u32 filter picks by destination, so ``src``'s other traffic
        (heartbeats, gRPC to the gateway) is not queued behind the KV bytes."""
        if delay_ms and not netem_available():
            raise RuntimeError("this kernel has no netem qdisc (sch_netem): no delay can be added")
        self.unshape(src)
        ns = src.namespace
        _tc(ns, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "10", "r2q", "1000")
        _tc(ns, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit")
        _tc(ns, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:30", "htb", "rate", f"{rate_mbit}mbit",
            "ceil", f"{rate_mbit}mbit")
        if delay_ms:
            _tc(ns, "qdisc", "add", "dev", "eth0", "parent", "1:30", "handle", "30:", "netem", "delay", f"{delay_ms}ms")
        for dst in to if isinstance(to, list) else [to]:
            _tc(ns, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                "match", "ip", "dst", f"{dst.address}/32", "flowid", "1:30")

    def unshape(self, src: Host) -> None:
        subprocess.run(["ip", "netns", "exec", src.namespace, "tc", "qdisc", "del", "dev", "eth0", "root"],
                       capture_output=True, timeout=30)  # absent already is fine

    # ---- teardown

    def close(self) -> None:
        """Delete every namespace (their veths go with them) and this namespace's leg."""
        for host in self.hosts.values():
            _ip("netns", "del", host.namespace, check=False)
            shutil.rmtree(os.path.join(SHM, host.namespace), ignore_errors=True)
        _ip("link", "del", self.root_link, check=False)
        _ip("netns", "del", self.bridge_ns, check=False)
        self.hosts.clear()

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
