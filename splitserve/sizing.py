"""How many KV pages and concurrent sequences a memory budget buys: ``python -m splitserve.sizing``.

    python -m splitserve.sizing --model smollm2-135m-instruct --kv-cache-memory-gb 20 --context-len 2048 8192
    python -m splitserve.sizing --name llama-3-8b --layers 32 --kv-heads 8 --head-dim 128 \\
        --kv-cache-memory-gb 50 --context-len 8192

The arithmetic is the engine's own (``engine.model_runner.ModelRunner``): one token's KV is
``2 (K and V) x layers x KV heads x head size x bytes per element``; a page holds
``--block-size`` tokens; the pool gets ``floor(budget in GiB x 2**30 / page bytes)`` pages,
which is what a worker started with the same ``--kv-cache-memory-gb`` allocates. With a quantized
``--kv-cache-dtype`` (int8, fp8...) an element is one byte and each (token, head) row of head-size
elements carries a 4-byte float32 scale (``engine/attention/kv_quant.py``). A sequence
of N tokens holds ``ceil(N / block size)`` pages, so a pool serves that many sequences at
full length at once (fewer long ones or more short ones; shared prefixes cost nothing extra).
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from engine.config import KV_CACHE_DTYPES, KV_SCALE_BYTES

# Bytes per element of the KV pool; "auto" is bfloat16, as in engine.model_runner.resolve_dtype.
DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class KVShape:
    """The parts of a model config that size its KV cache."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, name: str, config: dict) -> "KVShape":
        # The same fallbacks as ModelRunner: no num_key_value_heads means plain multi-head attention.
        heads = config["num_attention_heads"]
        return cls(name=name, layers=config["num_hidden_layers"],
                   kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads)


def load_shape(model: str) -> KVShape:
    """A checkpoint directory's config.json, or a model alias resolved as the workers resolve it."""
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        from engine.model_loader import resolve_model  # imports torch; only needed for aliases
        path = resolve_model(model)
    return KVShape.from_config(model, json.loads((path / "config.json").read_text()))


def kv_bytes_per_token(shape: KVShape, dtype: str, kv_cache_dtype: str = "auto") -> int:
    if kv_cache_dtype != "auto":  # 1-byte codes, and a float32 scale per (token, head) row
        return 2 * shape.layers * shape.kv_heads * (shape.head_dim + KV_SCALE_BYTES)
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * DTYPE_BYTES[dtype]


def pages_for(budget_gib: float, shape: KVShape, dtype: str, block_size: int, kv_cache_dtype: str = "auto") -> int:
    """Pages a worker allocates for ``--kv-cache-memory-gb budget_gib`` (ModelRunner._pool_blocks)."""
    return max(1, int(budget_gib * 2**30) // (kv_bytes_per_token(shape, dtype, kv_cache_dtype) * block_size))


def pages_per_sequence(context_len: int, block_size: int) -> int:
    return math.ceil(context_len / block_size)


def report(shape: KVShape, dtype: str, block_size: int, budget_gib: float, context_lens: list[int],
           workers: int = 1, kv_cache_dtype: str = "auto") -> str:
    per_token = kv_bytes_per_token(shape, dtype, kv_cache_dtype)
    per_page = per_token * block_size
    pages = pages_for(budget_gib, shape, dtype, block_size, kv_cache_dtype)
    dtype_name = "bfloat16" if dtype == "auto" else dtype
    if kv_cache_dtype == "auto":
        element = f"{dtype_name} ({DTYPE_BYTES[dtype]} B)"
        row = f"{shape.head_dim} x {DTYPE_BYTES[dtype]}"
    else:
        element = f"KV {kv_cache_dtype} (1 B, a {KV_SCALE_BYTES} B scale per token and head)"
        row = f"({shape.head_dim} + {KV_SCALE_BYTES}) x 1"
    lines = [
        f"model {shape.name}: {shape.layers} layers, {shape.kv_heads} KV heads, head size {shape.head_dim}, "
        f"{element}",
        f"KV bytes per token: 2 x {shape.layers} x {shape.kv_heads} x {row} "
        f"= {per_token:,} B ({per_token / 2**10:,.1f} KiB)",
        f"page of {block_size} tokens: {per_page:,} B",
        f"pool of {budget_gib:g} GiB: {pages:,} pages = {pages * block_size:,} tokens",
    ]
    for n in context_lens:
        need = pages_per_sequence(n, block_size)
        seqs = pages // need
        line = f"context {n:,} tokens: {need:,} pages each -> {seqs:,} concurrent sequences"
        if workers > 1:
            line += f" per worker, {seqs * workers:,} on {workers} workers"
        lines.append(line)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m splitserve.sizing",
                                description="KV pages and concurrent sequences for a KV memory budget")
    p.add_argument("--model", help="model alias or checkpoint directory (its config.json gives the shape)")
    p.add_argument("--name", default="custom", help="label for a shape given as numbers")
    p.add_argument("--layers", type=int, help="num_hidden_layers")
    p.add_argument("--kv-heads", type=int, help="num_key_value_heads")
    p.add_argument("--head-dim", type=int, help="head size (hidden_size / num_attention_heads unless set)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES), help="KV pool dtype (the worker's --dtype)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV page format (the worker's --kv-cache-dtype); quantized ones size pages by it, not --dtype")
    p.add_argument("--block-size", type=int, default=16, help="tokens per page (the worker's --block-size)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0,
                   help="KV budget of one worker in GiB (the worker's --kv-cache-memory-gb)")
    p.add_argument("--context-len", type=int, nargs="+", default=[2048],
                   help="tokens per sequence (prompt + output) to count concurrent sequences for")
    p.add_argument("--workers", type=int, default=1, help="decode workers with this budget (prints the total)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    numbers = (args.layers, args.kv_heads, args.head_dim)
    if args.model and any(v is not None for v in numbers):
        parser.error("give --model or --layers/--kv-heads/--head-dim, not both")
    if args.model:
        try:
            shape = load_shape(args.model)
        except (FileNotFoundError, ValueError, KeyError) as e:
            parser.error(f"cannot read the shape of {args.model!r}: {e}")
    elif all(v is not None for v in numbers):
        shape = KVShape(args.name, *numbers)
    else:
        parser.error("give --model, or all of --layers, --kv-heads and --head-dim")
    if min(shape.layers, shape.kv_heads, shape.head_dim, args.block_size, args.workers, *args.context_len) < 1:
        parser.error("layers, KV heads, head size, block size, workers and context lengths must be positive")
    if not args.kv_cache_memory_gb > 0:
        parser.error("--kv-cache-memory-gb must be positive")
    print(report(shape, args.dtype, args.block_size, args.kv_cache_memory_gb, args.context_len, args.workers,
                 args.kv_cache_dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
