"""The `splitserve` command: every subcommand has --help, and flags fall back to SPLITSERVE_* variables."""
import os
import subprocess
import sys

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

