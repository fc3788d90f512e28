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

    from worker_runtime.serve import engine_config
    before = torch.get_num_threads()
    try:
        engine_config(build_parser().parse_args(["decode", "--num-threads", "1"]))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_heartbeat_stats_do_not_wait_out_a_long_engine_step():
    """A worker mid-way through a multi-second step still beats, with its last numbers."""
    import asyncio
    import threading

    from worker_runtime.engine_loop import EngineLoop
    from worker_runtime.heartbeat import engine_stats

    go, busy, release = threading.Event(), threading.Event(), threading.Event()
    state = {"steps": 0}

    def long_step():
        state["steps"] += 1
        busy.set()
        release.wait(10)
        return []

    loop = EngineLoop(long_step, lambda: go.is_set() and state["steps"] < 1).start()

    async def main():
        stats = engine_stats(loop, lambda: {"steps": state["steps"]}, {"metrics_address": "127.0.0.1:9"})
        assert await stats() == {"steps": 0, "metrics_address": "127.0.0.1:9"}  # idle: fresh numbers
        go.set()
        loop.submit(lambda: None)  # wakes the loop, which now has work
        assert await asyncio.to_thread(busy.wait, 10)
        # Mid-step: the last numbers (waiting out the step would have read steps == 1).
        assert await stats() == {"steps": 0, "metrics_address": "127.0.0.1:9"}
        release.set()
        deadline = time.monotonic() + 10
        while (await stats())["steps"] != 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert (await stats())["steps"] == 1  # fresh again once the step is over
    try:
        asyncio.run(main())
    finally:
        release.set()
        loop.stop()
