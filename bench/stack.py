"""The systems the comparisons drive: a whole `splitserve up` stack, or the engine in-process.

``Stack`` starts ``splitserve up`` on a free port as a child process (it dies with this
process, even on ``kill -9``) and stops it on exit; several start side by side so A and B can
be interleaved in one run. ``InProcessBackend`` runs ``engine.LLMEngine`` on an engine-loop
thread in this process, with the same ``stream(request)`` interface as ``GrpcBackend``, so
the same load generator measures both (the cost of gRPC + Redis + gateway is the difference).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

from bench.workloads import BenchRequest
from splitserve.cli.launcher import die_with_parent, free_port

REPO = Path(__file__).resolve().parent.parent
BOOT_TIMEOUT_S = 300




class Stack:
    """``splitserve up <args>`` as a child process; ``address`` once ``wait_ready`` returned."""

    def __init__(self, name: str, up_args: Sequence[str]):
        self.name = name
        self.up_args = list(up_args)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.http_port = free_port()  # not up's default 8000: several stacks run side by side
        self.http = f"http://127.0.0.1:{self.http_port}"
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix=f"splitserve-bench-{name}-", suffix=".log", delete=False)

    @property
    def command(self) -> list[str]:
        return ["splitserve", "up", *self.up_args]

    def start(self) -> "Stack":
        argv = [sys.executable, "-m", "splitserve.cli", "up", "--port", str(self.port),
                "--http-port", str(self.http_port), *self.up_args]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
                                     preexec_fn=die_with_parent)
        return self

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, timeout_s: float = BOOT_TIMEOUT_S) -> "Stack":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "splitserve is up" in Path(self._log.name).read_text(errors="replace"):
                print(f"stack {self.name} up at {self.address}: {' '.join(self.command)}", flush=True)
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"stack {self.name} ({' '.join(self.command)}) did not come up "
                           f"(exit code {self.proc.poll()}); its log:\n{self.log_tail()}")

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def wait_stopped(self, timeout_s: float = 60.0) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # its children get SIGTERM from PR_SET_PDEATHSIG
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()
        os.unlink(self._log.name)


@contextlib.contextmanager
def running(stacks: Sequence[Stack]) -> Iterator[Sequence[Stack]]:
    """Start every stack side by side, wait until all are up; stop them all on exit."""
    t0 = time.monotonic()
    try:
        for stack in stacks:
            stack.start()
        for stack in stacks:
            stack.wait_ready()
        print(f"{len(stacks)} stack(s) up in {time.monotonic() - t0:.0f} s", flush=True)
        yield stacks
    finally:
        t0 = time.monotonic()
        for stack in stacks:
            stack.terminate()
        for stack in stacks:
            stack.wait_stopped()
        print(f"{len(stacks)} stack(s) stopped in {time.monotonic() - t0:.0f} s", flush=True)


class InProcessBackend:
    """``engine.LLMEngine`` stepped by ``splitserve.worker.engine_loop.EngineLoop`` (as a worker runs it),
    called directly: no gRPC, no Redis, no gateway, no detokenizer."""

    def __init__(self, config, num_threads: int = 0):
        import torch

        from splitserve.engine.llm_engine import LLMEngine
        from splitserve.worker.engine_loop import EngineLoop
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.engine = LLMEngine(config)
        self.loop = EngineLoop(lambda: [(o.request_id, o) for o in self.engine.step()],
                               self.engine.has_unfinished_requests, name="bench-engine").start()
        self._ids = itertools.count()

    def stream(self, request: BenchRequest, meta: dict) -> Iterator[list[int]]:
        from splitserve.engine.sampling_params import SamplingParams
        rid = f"bench-{next(self._ids)}"
        events = self.loop.subscribe_sync(rid)
        params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
        try:
            self.loop.call(lambda: self.engine.add_request(rid, list(request.prompt_token_ids), params))
            seen = 0
            while True:
                out = events.get(timeout=600)
                if isinstance(out, BaseException):
                    raise out
                if len(out.token_ids) > seen:
                    yield out.token_ids[seen:]
                    seen = len(out.token_ids)
                if out.finished:
                    return
        finally:
            self.loop.unsubscribe(rid)

    def close(self) -> None:
        self.loop.stop()
