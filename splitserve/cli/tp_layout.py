"""Tensor-parallel sizes compared for a box of GPUs: ``python -m splitserve.cli.sizing --gpus G ...``.

A layout is pairs of one prefill and one decode worker with the same ``--tensor-parallel-size N``
(a prefill and a decode worker of different sizes refuse each other: each rank hands its own
slice of the KV heads to the rank of the same number). A pair takes 2N GPUs, numbered as the
workers number them: rank r of a worker on ``--device cuda:K`` runs on cuda:K+r. Each GPU holds
its 1/N of the attention and MLP weights and a whole copy of the embeddings and norms
(``sizing.weight_bytes_per_gpu``), keeps ``--overhead-gb`` for activations and the CUDA context,
and gives the rest to its slice of the KV pool.

The suggestion is the smallest N whose decode worker holds ``--min-sequences`` sequences of the
longest context: a larger N buys KV room but spends more of every step on all-reduces and leaves
fewer pairs to serve side by side.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve.cli.sizing import (KVShape, describe, gib, kv_bytes_per_token, pages_per_sequence, tp_refusal,
                               weight_bytes_per_gpu)


@dataclass(frozen=True)
class Layout:
    """One tensor-parallel size on the box."""

    tensor_parallel_size: int
    # prefill + decode pairs the box holds at this size (2N GPUs each)
    pairs: int
    # bytes of weights on each GPU
    weight_bytes: int
    # KV budget of each GPU in GiB (the workers' --kv-cache-memory-gb), rounded down to 0.1; <= 0: no room
    kv_gib: float
    # pages of one worker's pool at that budget (0 without room)
    pages: int

    def sequences(self, context_len: int, block_size: int) -> int:
        return self.pages // pages_per_sequence(context_len, block_size)


def layouts(shape: KVShape, dtype: str, kv_cache_dtype: str, block_size: int, gpus: int, gpu_memory_gib: float,
            overhead_gib: float) -> list[Layout]:
    """Every size the model's heads allow and the box holds a pair of, smallest first."""
    out = []
    for tp in range(1, gpus // 2 + 1):
        if tp_refusal(shape, tp):
            continue
        weights = weight_bytes_per_gpu(shape, dtype, tp)
        # Rounded down so that the printed --kv-cache-memory-gb allocates exactly the printed pages.
        kv_gib = math.floor((gpu_memory_gib - overhead_gib - weights / 2**30) * 10) / 10
        per_page = kv_bytes_per_token(shape, dtype, kv_cache_dtype, tp) * block_size
        pages = int(kv_gib * 2**30) // per_page if kv_gib > 0 else 0
        out.append(Layout(tp, gpus // (2 * tp), weights, kv_gib, pages))
    return out


def suggest(options: list[Layout], context_len: int, block_size: int, min_sequences: int) -> Layout | None:
    return next((o for o in options if o.sequences(context_len, block_size) >= min_sequences), None)


def gpu_range(first: int, count: int) -> str:
    return str(first) if count == 1 else f"{first}-{first + count - 1}"


def pair_lines(option: Layout) -> list[str]:
    """Where each pair's workers run: prefill on the first N GPUs of its 2N, decode on the next N."""
    tp, lines = option.tensor_parallel_size, []
    for k in range(option.pairs):
        prefill, decode = 2 * k * tp, (2 * k + 1) * tp
        lines.append(f"  pair {k}: prefill on GPUs {gpu_range(prefill, tp)} (--device cuda:{prefill}), "
                     f"decode on GPUs {gpu_range(decode, tp)} (--device cuda:{decode}), "
                     f"--tensor-parallel-size {tp} --kv-cache-memory-gb {option.kv_gib:g}")
    return lines


def report(shape: KVShape, dtype: str, kv_cache_dtype: str, block_size: int, gpus: int, gpu_memory_gib: float,
           overhead_gib: float, context_len: int, min_sequences: int) -> str:
    lines = describe(shape, dtype, kv_cache_dtype)
    lines.append(f"{gpus} GPUs of {gpu_memory_gib:g} GiB, {overhead_gib:g} GiB of each kept for activations and "
                 f"the CUDA context, the rest for KV; pairs of prefill TP=N + decode TP=N:")
    options = layouts(shape, dtype, kv_cache_dtype, block_size, gpus, gpu_memory_gib, overhead_gib)
    for o in options:
        line = f"TP={o.tensor_parallel_size}: weights {gib(o.weight_bytes)} per GPU"
        if o.pages == 0:
            lines.append(line + ": no room left for KV")
            continue
        pairs = f"{o.pairs} pair{'s' if o.pairs > 1 else ''}"
        idle = gpus - 2 * o.tensor_parallel_size * o.pairs
        lines.append(f"{line} + KV {o.kv_gib:g} GiB: {o.pages:,} pages -> "
                     f"{o.sequences(context_len, block_size):,} sequences of {context_len:,} tokens per decode "
                     f"worker; {pairs}" + (f", {idle} GPU{'s' if idle > 1 else ''} idle" if idle else ""))
    best = suggest(options, context_len, block_size, min_sequences)
    if best is None:
        lines.append(f"no size gives a decode worker {min_sequences} sequences of {context_len:,} tokens: "
                     "more or larger GPUs, a shorter context or 8-bit KV (--kv-cache-dtype int8)")
    else:
        lines.append(f"suggested (the smallest TP holding {min_sequences} sequences of {context_len:,} tokens): "
                     f"TP={best.tensor_parallel_size}")
        lines += pair_lines(best)
    return "\n".join(lines)
