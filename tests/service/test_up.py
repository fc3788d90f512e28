"""`splitserve up` as a user runs it: on ports it picks (`--port 0`), grpcurl against it, no orphan once
it is killed, and a stop while it starts does not wait for the boot."""
import json
import os
import signal
import subprocess
import time
import urllib.request

import psutil
import pytest

from tests.harness.tools import grpcurl
from tests.harness.up import start_up


@pytest.fixture(scope="module")
def up(tiny_model_dirs, tmp_path_factory):
    with start_up(["--model", str(tiny_model_dirs["llama"]), "--dtype", "float32", "--block-size", "8",
                   "--num-gpu-blocks", "128", "--prefill", "1", "--decode", "1",
                   "--child-log-level", "INFO",  # each child's shutdown in up.log, for a failure's message
                   "--http-port", "0"],  # and --port 0 (below): up picks both ports and says which
                  tmp_path_factory.mktemp("up"), port=0) as running:
        yield running


def test_grpcurl_against_splitserve_up(up):
    # Started with --port 0 --http-port 0: up picked the ports, and its ready line says which.
    assert up.port != 0 and f"splitserve is up: gRPC 127.0.0.1:{up.port}, OpenAI HTTP" in up.process.line
    assert up.http_port != 0 and f"OpenAI HTTP {up.http}/v1" in up.process.line
    assert urllib.request.urlopen(f"{up.http}/health", timeout=30).status == 200
    run = lambda *a: subprocess.run([grpcurl(), "-plaintext", *a], capture_output=True, text=True, timeout=60)  # noqa
    assert "splitserve.v1.Generation" in run(up.address, "list").stdout
    assert "rpc Generate" in run(up.address, "describe", "splitserve.v1.Generation").stdout
    body = json.dumps({"text": "hello", "sampling": {"max_tokens": 4, "temperature": 0, "ignore_eos": True}})
    streamed = run("-d", body, up.address, "splitserve.v1.Generation/Generate")
    assert streamed.returncode == 0, streamed.stderr
    assert '"finish_reason": "length"' in streamed.stdout
    assert '"SERVING"' in run("-d", "{}", up.address, "grpc.health.v1.Health/Check").stdout
    info = json.loads(run("-d", "{}", up.address, "splitserve.v1.Generation/GetServerInfo").stdout)
    assert sorted(w["role"] for w in info["workers"]) == ["decode", "gateway", "prefill"]
    assert sorted(up.pids) == ["decode0", "gateway", "prefill0", "redis"]
    up.wait_log("splitserve up: as given (--prefill/--decode)")  # what it runs, and why


def test_the_workers_run_on_tcmalloc(up):
    """A worker restarts itself under tcmalloc before it loads torch (splitserve/cli/allocator.py); the
    gateway, which runs no model, keeps the system malloc."""
    def maps(name):
        with open(f"/proc/{up.pids[name]}/maps") as f:
            return f.read()
    assert "tcmalloc" in maps("decode0") and "tcmalloc" in maps("prefill0")
    assert "tcmalloc" not in maps("gateway")


def test_ups_redis_answers_only_its_children(up):
    """up's own Redis has a password (issue 36, point 10): a local client without it is refused,
    and the password is on no command line of up's processes (its children serve, so they have it)."""
    import redis
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(up.redis_url, socket_timeout=5).ping()
    config = os.path.join(psutil.Process(up.pids["redis"]).cwd(), "redis.conf")  # up's working directory
    [password] = [line.split()[1] for line in open(config) if line.startswith("requirepass ")]
    assert redis.Redis.from_url(up.redis_url, password=password, socket_timeout=5).ping()
    for proc in [psutil.Process(up.proc.pid), *psutil.Process(up.proc.pid).children(recursive=True)]:
        assert password not in " ".join(proc.cmdline()), proc.cmdline()[:4]


def test_kill_9_of_up_leaves_no_orphan(up):
    children = psutil.Process(up.proc.pid).children(recursive=True)
    assert len(children) >= 4  # redis, decode, prefill, gateway
    os.kill(up.proc.pid, signal.SIGKILL)
    up.proc.wait(timeout=10)
    gone, alive = psutil.wait_procs(children, timeout=30)
    if alive:  # what each survivor is doing: its stacks (SIGUSR1, splitserve/common/logs.py) and its log
        names = {pid: name for name, pid in up.pids.items()}
        for proc in alive:
            os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(2)
        pytest.fail(f"still running 30 s after up's kill -9: {[names.get(p.pid, p.cmdline()[:4]) for p in alive]}\n"
                    f"{up.log()[-12000:]}")


def test_a_sigterm_while_up_starts_stops_it_without_waiting_for_the_boot(tiny_model_dirs, tmp_path):
    """SIGTERM as soon as Redis is up, while the worker boots: up stops what it started and exits,
    without starting the gateway or waiting for the worker to be ready."""
    from splitserve.cli.launcher import UpProcess
    up = UpProcess("stopped", ["--model", str(tiny_model_dirs["llama"]), "--dtype", "float32",
                               "--num-gpu-blocks", "64", "--prefill", "0", "--decode", "0"],
                   log_path=tmp_path / "up.log", http=False).start()
    try:
        up.wait_log("redis (pid ", timeout_s=60)
        give_up = time.monotonic() + 30
        while len(children := psutil.Process(up.process.proc.pid).children(recursive=True)) < 2:  # Redis, worker
            assert time.monotonic() < give_up, "up started no worker"
            time.sleep(0.05)
        up.terminate()
        assert up.process.proc.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [p.cmdline()[:4] for p in alive]
        log = up.log()
        assert "splitserve up: stopped while starting" in log, log[-3000:]
        assert "gateway (pid " not in log and "splitserve is up" not in log, log[-3000:]
    finally:
        up.close()
