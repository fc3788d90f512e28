"""``free_port``: the port ``up`` and the tests give a process to bind later. Picked below the OS's
ephemeral range, so the ports the OS hands out meanwhile (binds to port 0, outgoing connections)
never take it; a compose test once lost its prefill worker's metrics port that way."""
import socket

from splitserve.common import processes
from splitserve.common.processes import _ephemeral_low, free_port


def test_a_free_port_is_below_the_ephemeral_range_and_bindable(monkeypatch):
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1  # random picks, not one fixed port
    taken, other = sorted(ports)[:2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", taken))
        s.listen()
        picks = iter([taken, taken, other])  # the random picks land on the taken port twice first

        class Picks:
            def randrange(self, start, stop):
                return next(picks)

        monkeypatch.setattr(processes.random, "SystemRandom", Picks)
        assert free_port() == other


def test_hundreds_of_ports_the_os_hands_out_never_meet_the_picked_one():
    port = free_port()
    held = []
    try:
        for _ in range(300):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
            assert s.getsockname()[1] != port
    finally:
        for s in held:
            s.close()
