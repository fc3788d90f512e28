"""`splitserve up` as a user runs it: grpcurl against it, and no orphan once it is killed."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from splitserve.testing.tools import grpcurl as _grpcurl


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def up(tiny_model_dirs):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "up", "--model", str(tiny_model_dirs["llama"]),
                             "--dtype", "float32", "--block-size", "8", "--num-gpu-blocks", "128", "--port", str(port)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    deadline = time.monotonic() + 180
    for line in proc.stdout:
        if "splitserve is up" in line or time.monotonic() > deadline:
            break
    assert "splitserve is up" in line, line
    yield proc, f"127.0.0.1:{port}"
    if proc.poll() is None:
        proc.kill()


def test_grpcurl_against_splitserve_up(up):
    _, address = up
    grpcurl = _grpcurl()
    run = lambda *a: subprocess.run([grpcurl, "-plaintext", *a], capture_output=True, text=True, timeout=60)  # noqa
    assert "splitserve.v1.Generation" in run(address, "list").stdout
    assert "rpc Generate" in run(address, "describe", "splitserve.v1.Generation").stdout
    body = json.dumps({"text": "hello", "sampling": {"max_tokens": 4, "temperature": 0, "ignore_eos": True}})
    streamed = run("-d", body, address, "splitserve.v1.Generation/Generate")
    assert streamed.returncode == 0, streamed.stderr
    assert '"finish_reason": "length"' in streamed.stdout
    assert '"SERVING"' in run("-d", "{}", address, "grpc.health.v1.Health/Check").stdout
    info = json.loads(run("-d", "{}", address, "splitserve.v1.Generation/GetServerInfo").stdout)
    assert sorted(w["role"] for w in info["workers"]) == ["decode", "gateway", "prefill"]


def test_kill_9_of_up_leaves_no_orphan(up):
    proc, _ = up
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 4  # redis, decode, prefill, gateway
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline()[:4] for p in alive]
