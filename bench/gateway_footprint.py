"""A gateway's start time and memory, a git revision's against the working tree's, alternated.

    python -m bench.gateway_footprint --base df5945e --rounds 3 --out bench/results/gateway_footprint.json

Each round starts ``splitserve gateway`` (the default model, a private Redis, no workers: the
gateway prints its ``serving on`` line once its model files, tokenizer, Redis client and servers
are up) from the base revision's tree (a ``git worktree`` of it) and from this one, in turns, and
records the seconds from spawn to that line, the process's resident memory a second later and
whether torch's library is mapped into it. The gateway never needs torch; the base revision is
how much it cost before it stopped loading it.
"""
from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import write_json
from splitserve.common.processes import free_port

ROOT = Path(__file__).resolve().parents[1]


def measure(tree: Path, redis_url: str, model: str) -> dict:
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "--log-level", "ERROR", "gateway", "--model", model,
                             "--port", "0", "--http-port", "-1", "--redis-url", redis_url],
                            stdout=subprocess.PIPE, text=True, cwd=tree, env={"PYTHONPATH": str(tree),
                                                                               "HF_HUB_OFFLINE": "1",
                                                                               "PATH": "/usr/bin:/bin"})
    try:
        for line in proc.stdout:
            if "serving on" in line:
                break
        else:
            raise RuntimeError(f"the gateway in {tree} exited with code {proc.wait()} before serving")
        seconds = time.monotonic() - started
        time.sleep(1.0)
        status = Path(f"/proc/{proc.pid}/status").read_text()
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
    finally:
        proc.terminate()
        proc.wait(30)
    return {"start_s": seconds, "rss_mib": int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024,
            "torch_mapped": "libtorch" in maps}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="git revision to compare with the working tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    base_tree = Path(tempfile.mkdtemp(prefix="gateway-footprint-")) / "base"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base_tree), args.base], cwd=ROOT, check=True)
    port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                             stdout=subprocess.DEVNULL)
    runs: dict[str, list[dict]] = {"base": [], "tree": []}
    try:
        time.sleep(0.5)
        for _ in range(args.rounds):
            for name, tree in (("base", base_tree), ("tree", ROOT)):
                runs[name].append(measure(tree, f"redis://127.0.0.1:{port}/0", args.model))
                print(name, runs[name][-1], flush=True)
    finally:
        redis.terminate()
        subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT)
        shutil.rmtree(base_tree.parent, ignore_errors=True)
    summary = {name: {"start_s_median": statistics.median(r["start_s"] for r in rs),
                      "rss_mib_median": statistics.median(r["rss_mib"] for r in rs),
                      "torch_mapped": any(r["torch_mapped"] for r in rs)} for name, rs in runs.items()}
    write_json(args.out, {"benchmark": "gateway_footprint", "base": args.base, "model": args.model,
                          "rounds": args.rounds, "method": __doc__.split("\n\n")[1], "runs": runs,
                          "summary": summary})
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
