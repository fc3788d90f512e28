"""The `splitserve` command: --help for everything, flags from EngineConfig and the environment,
clear errors, and `up` handing every flag to the children that take it."""
import dataclasses
import os
import subprocess
import sys
import time

import click
import pytest

from splitserve.engine.config import EngineConfig
from splitserve.cli.commands import parse
from splitserve.cli.flags import FLAGS, up_options

SUBCOMMANDS = ["up", "gateway", "prefill", "decode", "generate"]


def run_cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "splitserve.cli", *argv], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help_with_defaults_and_variables(command):
    out = run_cli(command, "--help")
    assert out.returncode == 0 and "Usage: splitserve" in out.stdout
    text = " ".join(out.stdout.split())  # help lines wrap anywhere
    if command != "generate":
        assert '[env var: SPLITSERVE_REDIS_URL; default: ""]' in text
        assert "[env var: SPLITSERVE_DRAIN_TIMEOUT_S; default: 30.0]" in text


def test_installed_entry_point_runs():
    entry_point = os.path.join(os.path.dirname(sys.executable), "splitserve")
    out = subprocess.run([entry_point, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and all(c in out.stdout for c in SUBCOMMANDS)


def test_every_engine_config_field_is_a_worker_flag_with_its_default(monkeypatch):
    for name in [k for k in os.environ if k.startswith("SPLITSERVE_")]:  # (the suite sets some)
        monkeypatch.delenv(name)
    for command in ("decode", "prefill", "up"):
        args = parse([command])
        for field in dataclasses.fields(EngineConfig):
            assert getattr(args, field.name) == field.default, (command, field.name)
    args = parse(["decode", "--preemption-mode", "swap", "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
                  "--priority-aging-per-s", "0.5", "--num-cpu-blocks", "8", "--attention-backend", "torch"])
    assert (args.preemption_mode, args.enable_prefix_caching, args.enable_chunked_prefill, args.priority_aging_per_s,
            args.num_cpu_blocks, args.attention_backend) == ("swap", False, False, 0.5, 8, "torch")


def test_environment_supplies_defaults(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_MODEL", "/models/x")
    monkeypatch.setenv("SPLITSERVE_PORT", "6000")
    monkeypatch.setenv("SPLITSERVE_REDIS_URL", "redis://r:6379/0")
    monkeypatch.setenv("SPLITSERVE_KV_TRANSPORT", "tcp")
    monkeypatch.setenv("SPLITSERVE_ENABLE_PREFIX_CACHING", "false")
    args = parse(["decode"])
    assert (args.model, args.port, args.redis_url, args.kv_transport) == ("/models/x", 6000, "redis://r:6379/0", "tcp")
    assert args.enable_prefix_caching is False
    # A flag on the command line wins over the environment.
    assert parse(["decode", "--port", "7000"]).port == 7000


def test_bad_values_are_usage_errors_naming_the_flag():
    with pytest.raises(click.BadParameter, match="int3"):
        parse(["decode", "--dtype", "int3"])
    out = run_cli("decode", env={"SPLITSERVE_BLOCK_SIZE": "abc"})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "'--block-size' (env var: 'SPLITSERVE_BLOCK_SIZE'): 'abc' is not a valid integer" in out.stderr
    out = run_cli("prefill", "--block-size", "3")  # refused by EngineConfig, before anything starts
    assert out.returncode == 2 and "block_size must be a power of two, got 3" in out.stderr
    out = run_cli("gateway", "--max-stop-sequences", "0")  # refused by RequestLimits
    assert out.returncode == 2 and "max_stop_sequences must be an integer >= 1, got 0" in out.stderr
    out = run_cli("gateway", env={"SPLITSERVE_REDIS_URL": ""})
    assert out.returncode == 1 and out.stderr.strip() == "splitserve: the gateway needs --redis-url (or " \
        "SPLITSERVE_REDIS_URL)"


def _value_for(option: click.Option, default):
    """A value different from the default, valid for the option's type."""
    if option.is_flag or option.is_bool_flag:
        return not default
    if isinstance(option.type, click.Choice):
        return next(c for c in option.type.choices if c != default)
    if option.type is click.INT or isinstance(option.type, click.IntRange):  # 7 and 8 are in every range so far
        return 7 if default != 7 else 8
    if option.type is click.FLOAT:
        return 2.5 if default != 2.5 else 3.5
    return f"/x/{option.name}"


def test_up_forwards_every_flag_to_each_child_that_takes_it(tmp_path):
    from splitserve.cli.flags import BY_NAME
    from splitserve.cli.up import plan
    argv = ["up", "--prefill", "2", "--decode", "1"]
    given = {}
    for option in up_options():
        if option.name in ("metrics_port", "num_threads", "redis_url", "block_size", "gpu_memory_utilization"):
            # up sets these per child (ports, threads, its own Redis, each worker's share of the GPU:
            # tests/test_gpu_memory.py); block_size must be a power of 2
            continue
        value = _value_for(option, option.default)
        given[option.name] = value
        flag = BY_NAME[option.name]
        argv += flag.argv(value) if not flag.secret else [flag.option, str(value)]
    argv += ["--block-size", "32", "--num-gpu-blocks", "64"]
    given.update(block_size=32, num_gpu_blocks=64)
    specs = {spec.name: spec for spec in plan(parse(argv), "redis://127.0.0.1:1/0", str(tmp_path))}
    assert sorted(specs) == ["decode0", "gateway", "prefill0", "prefill1", "redis"]
    for name, spec in specs.items():
        if name == "redis":
            continue
        cli = spec.argv.index("splitserve.cli")
        command = spec.argv[cli + 3:]  # after --log-level LEVEL
        old = dict(os.environ)
        os.environ.update(spec.env)  # secrets travel in the environment
        try:
            child = parse(command)
        finally:
            os.environ.clear()
            os.environ.update(old)
        kind = "gateway" if name == "gateway" else "prefill" if name.startswith("prefill") else "decode"
        for flag_name, value in given.items():
            flag = BY_NAME[flag_name]
            if kind in (flag.up_to or flag.kinds):
                assert getattr(child, flag_name) == value, (name, flag_name)
        for secret in ("auth_token", "redis_password"):
            assert given[secret] not in spec.argv, (name, secret)  # never on a command line
    assert all(flag.name in {o.name for o in up_options()} for flag in FLAGS if flag.up)


def test_num_threads_sets_the_engine_threads():
    import torch

    from splitserve.worker.serve import engine_config
    before = torch.get_num_threads()
    try:
        engine_config(parse(["decode", "--num-threads", "1"]))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_heartbeat_stats_do_not_wait_out_a_long_engine_step():
    """A worker mid-way through a multi-second step still beats, with its last numbers."""
    import asyncio
    import threading

    from splitserve.worker.engine_loop import EngineLoop
    from splitserve.worker.heartbeat import engine_stats

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


def test_up_gives_each_rank_of_a_tensor_parallel_worker_its_share_of_the_cores(tmp_path, monkeypatch):
    """8 cores, a prefill and a decode worker of 2 ranks each: 4 rank processes, 2 threads each
    (1 rank each: 4 threads)."""
    from splitserve.cli import up
    monkeypatch.setattr(up.os, "cpu_count", lambda: 8)
    for tp, threads in ((1, "4"), (2, "2")):
        argv = ["up", "--prefill", "1", "--decode", "1", "--tensor-parallel-size", str(tp)]
        specs = {spec.name: spec.argv for spec in up.plan(parse(argv), "redis://127.0.0.1:1/0", str(tmp_path))}
        for name in ("prefill0", "decode0"):
            child = specs[name]
            assert child[child.index("--num-threads") + 1] == threads, (tp, name)
            if tp > 1:
                assert child[child.index("--tensor-parallel-size") + 1] == "2", name


def test_up_splits_prefill_and_decode_workers_over_their_own_ranks(tmp_path, monkeypatch):
    """--prefill-tensor-parallel-size 1 --decode-tensor-parallel-size 2 on 6 cores: the prefill
    worker one rank, the decode worker two, 2 threads per rank; a transport list that cannot
    re-shard KV by head is refused at start naming the flags."""
    from splitserve.cli import up
    monkeypatch.setattr(up.os, "cpu_count", lambda: 6)
    argv = ["up", "--prefill", "1", "--decode", "1", "--prefill-tensor-parallel-size", "1",
            "--decode-tensor-parallel-size", "2"]
    specs = {spec.name: spec.argv for spec in up.plan(parse(argv), "redis://127.0.0.1:1/0", str(tmp_path))}
    for name, ranks in (("prefill0", "1"), ("decode0", "2")):
        child = specs[name]
        assert child.count("--tensor-parallel-size") == 1, name
        assert child[child.index("--tensor-parallel-size") + 1] == ranks, name
        assert child[child.index("--num-threads") + 1] == "2", name
    up.check_split(parse(argv))  # auto: shm on CPU
    up.check_split(parse([*argv, "--kv-transport", "tcp"]))
    with pytest.raises(SystemExit, match="--prefill-tensor-parallel-size 1 and --decode-tensor-parallel-size 2 "
                                         "differ: KV is re-sharded by head over shm, cuda_ipc, tcp only"):
        up.check_split(parse([*argv, "--kv-transport", "nccl"]))


def test_up_puts_prefill_and_decode_workers_on_devices_of_their_own(tmp_path):
    """--prefill-device cuda:0 --decode-device cuda:1: each worker's command line names its GPU once,
    and --gpu-memory-utilization is each GPU's, split only among the workers that share it; the
    role controller (which moves a worker to the other role in place) is refused beside them."""
    from splitserve.cli import up
    argv = ["up", "--prefill", "1", "--decode", "2", "--prefill-device", "cuda:0", "--decode-device", "cuda:1",
            "--gpu-memory-utilization", "0.9"]
    specs = {spec.name: spec.argv for spec in up.plan(parse(argv), "redis://127.0.0.1:1/0", str(tmp_path))}
    for name, device, share in (("prefill0", "cuda:0", "0.9000"), ("decode0", "cuda:1", "0.4500"),
                                ("decode1", "cuda:1", "0.4500")):
        child = specs[name]
        assert child.count("--device") == 1 and child[child.index("--device") + 1] == device, name
        assert child[child.index("--gpu-memory-utilization") + 1] == share, name
    assert "--device" not in specs["gateway"]
    # One device for both (the default): the shares of one GPU, as before.
    specs = {spec.name: spec.argv for spec in up.plan(parse(["up", "--prefill", "1", "--decode", "1", "--device",
                                                             "cuda:2", "--gpu-memory-utilization", "0.9"]),
                                                      "redis://127.0.0.1:1/0", str(tmp_path))}
    assert [specs[n][specs[n].index("--device") + 1] for n in ("prefill0", "decode0")] == ["cuda:2", "cuda:2"]
    assert [specs[n][specs[n].index("--gpu-memory-utilization") + 1] for n in ("prefill0", "decode0")] == \
        ["0.3000", "0.6000"]
    up.check_devices(parse(argv), role_controller=False)
    with pytest.raises(SystemExit, match="--role-controller moves workers between roles in place: it does not go "
                                         "with --prefill-device cuda:0 and --decode-device cuda:1"):
        up.check_devices(parse(argv), role_controller=True)


def test_up_gives_its_own_redis_a_password_only_its_children_learn(tmp_path):
    """Issue 36, point 10: a Redis without a password is open to every local user (a fake worker
    could register and be sent prompts). up's own Redis gets a fresh random one, in a config file
    only this user reads, never on a command line; the children get it in their environment."""
    import stat

    from splitserve.cli import up
    from splitserve.cli.flags import BY_NAME
    specs = {spec.name: spec for spec in up.plan(parse(["up"]), "redis://127.0.0.1:1/0", str(tmp_path))}
    config = tmp_path / "redis.conf"
    [password] = [line.split()[1] for line in config.read_text().splitlines() if line.startswith("requirepass ")]
    assert len(password) >= 32 and stat.S_IMODE(config.stat().st_mode) == 0o600
    assert specs["redis"].argv[1] == str(config)
    envvar = BY_NAME["redis_password"].envvar
    for name, spec in specs.items():
        assert password not in " ".join(spec.argv), name
        if name != "redis":
            assert spec.env[envvar] == password, name
    # Another run, another password; one given is used as it is; a Redis of the operator's is theirs.
    (tmp_path / "x").mkdir()
    again = {s.name: s for s in up.plan(parse(["up"]), "redis://127.0.0.1:1/0", str(tmp_path / "x"))}
    assert again["gateway"].env[envvar] != password
    given = {s.name: s for s in up.plan(parse(["up", "--redis-password", "s3cret-pw"]), "redis://127.0.0.1:1/0",
                                        str(tmp_path / "x"))}
    assert given["gateway"].env[envvar] == "s3cret-pw"
    assert (tmp_path / "x" / "redis.conf").read_text() == "requirepass s3cret-pw\n"
    theirs = {s.name: s for s in up.plan(parse(["up", "--redis-url", "redis://10.0.0.9:6379/0"]),
                                         "redis://10.0.0.9:6379/0", str(tmp_path / "x"))}
    assert "redis" not in theirs and envvar not in theirs["gateway"].env


def test_up_without_prefill_or_decode_chooses_from_the_device_and_the_cores(tmp_path, monkeypatch):
    """Issue 41, point 2: on a CPU of fewer than 4 cores, one colocated worker (split in two,
    each worker gets one core and first tokens wait for the prefill worker); otherwise, and on a
    GPU, one prefill and one decode worker; what is given is kept (one count alone: the other 1).
    up says which at start and why."""
    from splitserve.cli import up
    counts = lambda t: (t.prefill, t.decode)  # noqa: E731
    auto = parse(["up", "--device", "cpu"])  # auto: cpu where no NVIDIA device node is
    assert counts(up.topology(auto, cores=2)) == (0, 0) and "one colocated worker: 2 cores" in up.topology(auto, 2).why
    assert counts(up.topology(auto, cores=3)) == (0, 0)
    assert counts(up.topology(auto, cores=4)) == (1, 1) and "4 cores" in up.topology(auto, 4).why
    assert counts(up.topology(parse(["up", "--device", "cuda"]), cores=2)) == (1, 1)
    assert up.topology(parse(["up", "--prefill", "1", "--decode", "1"]), cores=2) == up.Topology(
        1, 1, "as given (--prefill/--decode)")
    assert counts(up.topology(parse(["up", "--prefill", "2"]), cores=2)) == (2, 1)
    assert counts(up.topology(parse(["up", "--decode", "0", "--prefill", "0"]), cores=64)) == (0, 0)
    with pytest.raises(click.BadParameter):
        parse(["up", "--prefill", "-1"])
    monkeypatch.setattr(up.os, "cpu_count", lambda: 2)
    names = [spec.name for spec in up.plan(auto, "redis://127.0.0.1:1/0", str(tmp_path))]
    assert names == ["redis", "both", "gateway"]
    monkeypatch.setattr(up.os, "cpu_count", lambda: 8)
    (tmp_path / "x").mkdir()
    names = [spec.name for spec in up.plan(auto, "redis://127.0.0.1:1/0", str(tmp_path / "x"))]
    assert names == ["redis", "decode0", "prefill0", "gateway"]


def test_up_on_2_cores_shares_them_between_a_prefill_and_a_decode_worker(tmp_path, monkeypatch):
    """Issue 41, point 2: ``up --prefill 1 --decode 1`` on 2 cores gives each worker a thread per
    core (bound one a core by the worker) and the decode engine the lowest priority, so a prompt's
    prefill takes both cores and decoding has them between prompts; thread counts given split them,
    and more cores split them as before. up says so at start."""
    from splitserve.cli import up
    monkeypatch.delenv("SPLITSERVE_NO_THREAD_BINDING", raising=False)  # the suite's own (conftest)

    def workers(argv: list[str], cores: int, workdir: str) -> dict[str, dict[str, str]]:
        monkeypatch.setattr(up.os, "cpu_count", lambda: cores)
        (tmp_path / workdir).mkdir()
        specs = up.plan(parse(["up", "--device", "cpu", *argv]), "redis://127.0.0.1:1/0", str(tmp_path / workdir))
        flag = lambda spec, name: spec.argv[spec.argv.index(name) + 1]  # noqa: E731
        return {s.name: {"threads": flag(s, "--num-threads"), "nice": flag(s, "--engine-niceness"),
                         "unbound": str("--no-thread-binding" in s.argv)}
                for s in specs if s.name in ("prefill0", "decode0", "both")}

    shared = workers(["--prefill", "1", "--decode", "1"], 2, "shared")
    assert shared == {"prefill0": {"threads": "2", "nice": "5", "unbound": "False"},
                      "decode0": {"threads": "2", "nice": "19", "unbound": "False"}}
    note = up.startup_note(parse(["up", "--device", "cpu", "--prefill", "1", "--decode", "1"]), cores=2)
    assert "share them, each with 2 threads bound one a core" in note and "nice 19" in note
    split = workers(["--prefill", "1", "--decode", "1", "--prefill-threads", "1", "--decode-threads", "1"], 2, "split")
    assert split == {"prefill0": {"threads": "1", "nice": "5", "unbound": "False"},
                     "decode0": {"threads": "1", "nice": "5", "unbound": "False"}}
    assert workers(["--prefill", "1", "--decode", "1"], 8, "big") == {
        "prefill0": {"threads": "4", "nice": "5", "unbound": "False"},
        "decode0": {"threads": "4", "nice": "5", "unbound": "False"}}
    assert "share" not in up.startup_note(parse(["up", "--device", "cpu", "--prefill", "1", "--decode", "1"]), cores=8)
    # 3 cores (a team of 3 is not bound) and two prefill workers (one priority) split them.
    assert workers(["--prefill", "1", "--decode", "1"], 3, "three")["decode0"] == {
        "threads": "1", "nice": "5", "unbound": "False"}
    assert workers(["--prefill", "2", "--decode", "1"], 2, "two_prefill")["decode0"]["nice"] == "5"
    unbound = up.startup_note(parse(["up", "--device", "cpu", "--prefill", "1", "--decode", "1",
                                     "--no-thread-binding"]), cores=2)
    assert "share them" in unbound and "bound" not in unbound
    # One colocated worker keeps the usual priority; --no-thread-binding reaches the workers.
    assert workers(["--no-thread-binding"], 2, "colocated") == {"both": {"threads": "2", "nice": "5", "unbound": "True"}}
