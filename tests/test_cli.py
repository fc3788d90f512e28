"""The `splitserve` command: every subcommand has --help, and flags fall back to SPLITSERVE_* variables."""
import os
import subprocess
import sys
import time

import pytest

from splitserve.cli import build_parser

SUBCOMMANDS = ["up", "gateway", "prefill", "decode", "generate"]


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(command):
    out = subprocess.run([sys.executable, "-m", "splitserve.cli", command, "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "usage: splitserve" in out.stdout


def test_installed_entry_point_runs():
    entry_point = os.path.join(os.path.dirname(sys.executable), "splitserve")
    out = subprocess.run([entry_point, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and all(c in out.stdout for c in SUBCOMMANDS)


def test_environment_supplies_defaults(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_MODEL", "/models/x")
    monkeypatch.setenv("SPLITSERVE_PORT", "6000")
    monkeypatch.setenv("SPLITSERVE_REDIS_URL", "redis://r:6379/0")
    monkeypatch.setenv("SPLITSERVE_KV_TRANSPORT", "tcp")
    args = build_parser().parse_args(["decode"])
    assert (args.model, args.port, args.redis_url, args.kv_transport) == ("/models/x", 6000, "redis://r:6379/0", "tcp")
    # A flag on the command line wins over the environment.
    assert build_parser().parse_args(["decode", "--port", "7000"]).port == 7000


def test_bad_flag_value_is_refused():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--dtype", "int3"])


def test_num_threads_sets_the_engine_threads():
    import torch

    from splitserve.cli import _engine_config
    before = torch.get_num_threads()
    try:
        _engine_config(build_parser().parse_args(["decode", "--num-threads", "1"]))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)



def test_heartbeat_stats_do_not_wait_out_a_long_engine_step():
    """A worker mid-way through a multi-second step still beats, with its last numbers."""
    import threading

    from splitserve.cli import _stats_for_heartbeat
    from splitserve.engine_loop import EngineLoop

    go, busy, release = threading.Event(), threading.Event(), threading.Event()
    state = {"steps": 0}

    def long_step():
        state["steps"] += 1
        busy.set()
        release.wait(10)
        return []

    class Servicer:
        loop = EngineLoop(long_step, lambda: go.is_set() and state["steps"] < 1)
        engine = type("Engine", (), {"stats": staticmethod(lambda: {"steps": state["steps"]})})

    Servicer.loop.start()
    try:
        stats = _stats_for_heartbeat(Servicer, "127.0.0.1:9")
        assert stats() == {"steps": 0, "metrics_address": "127.0.0.1:9"}  # idle: fresh numbers
        go.set()
        assert busy.wait(10)
        assert stats() == {"steps": 0, "metrics_address": "127.0.0.1:9"}  # mid-step: the last ones, no wait
        release.set()
        deadline = time.monotonic() + 10
        while stats()["steps"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats()["steps"] == 1  # fresh again once the step is over
    finally:
        release.set()
        Servicer.loop.stop()
