"""What every benchmark records beside its figures: machine, commit, config, and how A/B were run."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import threading
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
    from splitserve.allocator import preloaded
    import torch
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        # This process's malloc (splitserve.allocator): served workers pick it the same way.
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
