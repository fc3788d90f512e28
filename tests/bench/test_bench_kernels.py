"""bench/kernels.py end to end: HEAD's prefill kernel built beside the working tree's and run in turns
(on a CPU with AMX tiles the AMX one, which the engine's bf16 prefills run there; elsewhere the paged
one: one build of the base, ~15-40 s of compiling, either way). No timing asserted: the JSON must hold
both builds' times and how far their outputs differ."""
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"prefill": "splitserve/engine/attention/csrc/prefill_attention_cpu.cpp",
           "amx": "splitserve/engine/attention/csrc/fresh_prefill_amx_cpu.cpp"}
AMX = torch.cpu._is_amx_tile_supported()


def run_kernels(*args: str) -> subprocess.CompletedProcess:
    # A process of its own: the base build registers its ops for the life of the process.
    return subprocess.run([sys.executable, "-m", "bench.kernels", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_the_base_revision_and_the_working_tree_run_in_turns(tmp_path):
    out = tmp_path / "kernels.json"
    kernel = "amx" if AMX else "prefill"
    done = run_kernels("--base", "HEAD", "--kernels", kernel, "--quick", "--dtypes", "float32,bfloat16",
                       "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert report["base"] == head
    expected = [("amx", "bfloat16")] if AMX else [("prefill", "float32"), ("prefill", "bfloat16")]
    assert [(c["kernel"], c["dtype"]) for c in report["cases"]] == expected
    for case in report["cases"]:
        assert case["base_ms"] > 0 and case["head_ms"] > 0
        assert all(len(times) == 2 for times in case["rounds_ms"].values())
        assert case["max_abs_diff"] < 1e-2
        unchanged = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", SOURCES[case["kernel"]]],
                                   cwd=ROOT).returncode == 0
        if unchanged:  # the same source built twice computes the same bits
            assert case["max_abs_diff"] == 0.0


def test_an_unknown_kernel_is_refused(tmp_path):
    done = run_kernels("--kernels", "prefil", "--out", str(tmp_path / "x.json"))
    assert done.returncode == 2 and "unknown kernels ['prefil']" in done.stderr


def test_a_run_with_no_case_is_refused_before_anything_is_built(tmp_path):
    # amx times bf16 only: with float32 alone there is nothing to run, on any CPU.
    done = run_kernels("--kernels", "amx", "--dtypes", "float32", "--out", str(tmp_path / "x.json"))
    assert done.returncode == 2 and "no case to run: --kernels amx with --dtypes float32" in done.stderr
    assert not (tmp_path / "x.json").exists()
