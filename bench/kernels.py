"""The CPU attention kernels of a git revision against the working tree's, alternated in one process.

    python -m bench.kernels --base HEAD~1 --out bench/results/kernels.json

A kernel change is judged on the kernel: the two builds run the same inputs in turns (base,
working tree, base, ...; each turn a few calls), so a noisy VM moves both alike, and the medians
are compared. The base revision's ``csrc/paged_attention_cpu.cpp`` and
``csrc/prefill_attention_cpu.cpp`` are taken with ``git show``, their ops renamed to
``torch.ops.splitserve_cpu_base`` and built with the engine's own flags; the working tree's are
``splitserve.engine.attention.cpu_kernels`` as the engine loads them. Each case also records the largest
difference between the two outputs (0 when the arithmetic did not change).

Cases, with SmolLM2-135M's heads (9 query, 3 KV, head size 64), pages of 16 tokens laid out
head-major as the engine's CPU pools are:
* prefill: one chunk of each ``--prompt-lens`` tokens, causal over itself;
* decode: 64 sequences of 612 tokens sharing a 512-token prefix, and 64 of 300 tokens each;
* amx: one fresh chunk (no cached context) of each ``--prompt-lens`` tokens, the AMX kernel of
  ``csrc/fresh_prefill_amx_cpu.cpp`` (bf16 only, on a CPU with AMX tiles; other dtypes skip it).
"""
from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import median, write_json

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"decode": "paged_attention_cpu.cpp", "prefill": "prefill_attention_cpu.cpp",
           "amx": "fresh_prefill_amx_cpu.cpp"}
BASE_NAMESPACE = "splitserve_cpu_base"
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def build_base(revision: str, kernels: list[str]) -> str:
    """Build ``revision``'s ``kernels`` (keys of SOURCES) under ``BASE_NAMESPACE``; returns its commit id."""
    from torch.utils import cpp_extension

    from splitserve.engine.attention.cpu_kernels import CFLAGS
    from splitserve.engine.model_loader import cache_dir
    commit = subprocess.run(["git", "rev-parse", revision], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    names = [SOURCES[kernel] for kernel in kernels]
    texts = []
    for name in names:
        text = subprocess.run(["git", "show", f"{commit}:splitserve/engine/attention/csrc/{name}"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
        texts.append(re.sub(r"\b(TORCH_LIBRARY(?:_FRAGMENT|_IMPL)?)\(splitserve_cpu,", rf"\1({BASE_NAMESPACE},", text))
    key = hashlib.sha256("".join(texts).encode() + " ".join(CFLAGS).encode() + torch.__version__.encode()).hexdigest()[:16]
    build_dir = cache_dir() / "torch_extensions" / f"bench-base-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in zip(names, texts):
        path = build_dir / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        paths.append(str(path))
    cpp_extension.load(name=f"splitserve_cpu_base_{key}", sources=paths, extra_cflags=CFLAGS,
                       extra_ldflags=["-fopenmp"], build_directory=str(build_dir), is_python_module=False)
    return commit


def pages(num_blocks: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """A pool of head-major pages seen as [blocks, block_size, kv_heads, head_dim] (the kernels' view)."""
    pool = torch.randn(num_blocks, KV_HEADS, BLOCK, HEAD_DIM, generator=generator).to(dtype)
    return pool.transpose(1, 2)


def prefill_case(tokens: int, dtype: torch.dtype, generator: torch.Generator):
    blocks = -(-tokens // BLOCK)
    k, v = pages(blocks, dtype, generator), pages(blocks, dtype, generator)
    query = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator).to(dtype)
    args = (query, k, v, torch.arange(blocks, dtype=torch.int32)[None], torch.tensor([0, tokens], dtype=torch.int32),
            torch.tensor([tokens], dtype=torch.int32), 0, HEAD_DIM ** -0.5)
    return "paged_prefill", query, args, max(1, 2048 // tokens)


def amx_case(tokens: int, dtype: torch.dtype, generator: torch.Generator):
    query = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator).to(dtype)
    key, value = (torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=generator).to(dtype) for _ in range(2))
    return "fresh_prefill_amx", query, (query, key, value, [0, tokens], HEAD_DIM ** -0.5), max(1, 2048 // tokens)


def decode_case(seqs: int, prefix: int, own: int, dtype: torch.dtype, generator: torch.Generator):
    shared = list(range(prefix // BLOCK))
    per_seq = -(-(prefix + own) // BLOCK) - len(shared)
    tables = [shared + list(range(len(shared) + s * per_seq, len(shared) + (s + 1) * per_seq)) for s in range(seqs)]
    blocks = len(shared) + seqs * per_seq
    k, v = pages(blocks, dtype, generator), pages(blocks, dtype, generator)
    query = torch.randn(seqs, HEADS, HEAD_DIM, generator=generator).to(dtype)
    args = (query, k, v, torch.tensor(tables, dtype=torch.int32), torch.full((seqs,), prefix + own, dtype=torch.int32),
            HEAD_DIM ** -0.5)
    return "paged_decode", query, args, 10


def alternate(op_name: str, query: torch.Tensor, args: tuple, calls: int, rounds: int) -> dict:
    ops = {"base": getattr(torch.ops.splitserve_cpu_base, op_name), "head": getattr(torch.ops.splitserve_cpu, op_name)}
    outs = {arm: torch.empty_like(query) for arm in ops}
    for arm, op in ops.items():  # warm-up, and the outputs compared
        op(outs[arm], *args)
    diff = (outs["base"].float() - outs["head"].float()).abs().max().item()
    times = {arm: [] for arm in ops}
    for _ in range(rounds):
        for arm, op in ops.items():
            start = time.perf_counter()
            for _ in range(calls):
                op(outs[arm], *args)
            times[arm].append((time.perf_counter() - start) / calls * 1e3)
    base, head = median(times["base"]), median(times["head"])
    return {"base_ms": base, "head_ms": head, "head_over_base": head / base, "max_abs_diff": diff,
            "rounds_ms": times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision whose kernels are the baseline")
    parser.add_argument("--prompt-lens", default="256,1024,2048", help="prefill chunk lengths (tokens)")
    parser.add_argument("--kernels", default="prefill,decode",
                        help="which kernels, comma-separated: prefill, decode, amx (bf16 on AMX CPUs)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rounds", type=int, default=14, help="turns of each build per case")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny cases, 2 rounds (times nothing)")
    parser.add_argument("--out", default="bench/results/kernels.json")
    args = parser.parse_args(argv)

    kernels = args.kernels.split(",")
    unknown = set(kernels) - set(SOURCES)
    if unknown:
        parser.error(f"unknown kernels {sorted(unknown)}; choose from {sorted(SOURCES)}")
    lens = [40] if args.quick else [int(n) for n in args.prompt_lens.split(",")]
    decodes = [{"seqs": 4, "prefix": 32, "own": 8}] if args.quick else [{"seqs": 64, "prefix": 512, "own": 100},
                                                                       {"seqs": 64, "prefix": 0, "own": 300}]
    planned = []  # (dtype name, kernel, shape), in the order they run
    for dtype_name in args.dtypes.split(","):
        specs = [("prefill", {"tokens": n}) for n in lens]
        if dtype_name == "bfloat16" and torch.cpu._is_amx_tile_supported():
            specs += [("amx", {"tokens": n}) for n in lens]
        specs += [("decode", shape) for shape in decodes]
        planned += [(dtype_name, kernel, shape) for kernel, shape in specs if kernel in kernels]
    if not planned:
        parser.error(f"no case to run: --kernels {args.kernels} with --dtypes {args.dtypes}"
                     + ("" if torch.cpu._is_amx_tile_supported() else " (amx runs bf16 on a CPU with AMX tiles)"))
    from splitserve.engine.attention import cpu_kernels
    cpu_kernels.load()
    base_commit = build_base(args.base, sorted({kernel for _, kernel, _ in planned}))
    generator = torch.Generator().manual_seed(0)
    rounds = 2 if args.quick else args.rounds
    cases = []
    for dtype_name, kernel, shape in planned:
        dtype = getattr(torch, dtype_name)
        if kernel == "decode":
            built = decode_case(shape["seqs"], shape["prefix"], shape["own"], dtype, generator)
        else:
            built = (prefill_case if kernel == "prefill" else amx_case)(shape["tokens"], dtype, generator)
        result = {"kernel": kernel, "dtype": dtype_name, **shape, **alternate(*built, rounds=rounds)}
        cases.append(result)
        print(f"{kernel:8s} {dtype_name:9s} {shape}  base {result['base_ms']:.3f} ms  head {result['head_ms']:.3f} ms"
              f"  ({result['head_over_base']:.2f}x)  max |diff| {result['max_abs_diff']:.2g}", flush=True)
    write_json(args.out, {
        "benchmark": "kernels", "base": base_commit, "quick": args.quick,
        "method": "one process, the base revision's kernels and the working tree's called in turns on the same "
                  "inputs; per case `rounds` turns each of `calls` calls; medians of the per-call ms",
        "shapes": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK,
                   "page_order": "head-major"},
        "threads": torch.get_num_threads(), "cases": cases})
    return 0


if __name__ == "__main__":
    sys.exit(main())
