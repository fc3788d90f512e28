"""How many KV pages and concurrent sequences a memory budget buys: ``python -m splitserve.cli.sizing``.

    python -m splitserve.cli.sizing --model smollm2-135m-instruct --kv-cache-memory-gb 20 --context-len 2048 8192
    python -m splitserve.cli.sizing --name llama-3-8b --layers 32 --kv-heads 8 --head-dim 128 \\
        --kv-cache-memory-gb 50 --context-len 8192
    python -m splitserve.cli.sizing --model /models/llama-3-70b --context-len 8192 --gpus 8 --gpu-memory-gb 80

The arithmetic is the engine's own (``splitserve.engine.kv_sizes``): one token's KV is
``2 (K and V) x layers x KV heads x head size x bytes per element``; a page holds
``--block-size`` tokens; the pool gets ``floor(budget in GiB x 2**30 / page bytes)`` pages,
which is what a worker started with the same ``--kv-cache-memory-gb`` allocates. With a quantized
``--kv-cache-dtype`` (int8, fp8...) an element is one byte and each (token, head) row of head-size
elements carries a 4-byte float32 scale (``splitserve/engine/attention/kv_quant.py``). A sequence
of N tokens holds ``ceil(N / block size)`` pages, so a pool serves that many sequences at
full length at once (fewer long ones or more short ones; shared prefixes cost nothing extra).

A model with sliding-window layers (Gemma 2/3, gpt-oss, Mistral) served by a colocated worker
gives those layers' pages back behind the window (``splitserve.engine.kv_groups``): its pages hold
one group of layers each, and a sequence holds the full layers' pages plus a window's worth per
windowed group; the report adds those figures. Disaggregated workers keep every page (the
figures above them, and every ``--gpus`` layout).

With ``--tensor-parallel-size N`` a worker is N ranks on N GPUs, each holding 1/N of the KV heads:
a page costs each GPU 1/N of its bytes, and ``--kv-cache-memory-gb`` is each rank's (each GPU's)
budget, so the same budget holds N times the pages. ``--gpus`` compares tensor-parallel sizes
for a box (the layouts below).
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from splitserve.engine import kv_sizes
from splitserve.engine.config import KV_CACHE_DTYPES, KV_SCALE_BYTES

# Bytes per element of the KV pool; "auto" is bfloat16, as in splitserve.engine.model_runner.resolve_dtype.
DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class KVShape:
    """The parts of a model config that size its KV cache and, where known, its weights."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    # Attention (query) heads: tensor parallelism must divide them too. None: not given.
    heads: int | None = None
    # For the weights' size (Llama-family projections, no biases); None: not given.
    hidden_size: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    tied_embeddings: bool = False
    # Each layer's sliding window (0: full attention), as the engine reads the config; () when
    # no layer has one.
    windows: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, name: str, config: dict) -> "KVShape":
        # The same fallbacks as ModelRunner: no num_key_value_heads means plain multi-head attention.
        from types import SimpleNamespace

        from splitserve.engine.kv_groups import layer_windows
        heads = config["num_attention_heads"]
        windows = layer_windows(SimpleNamespace(**{k: config.get(k) for k in
                                                   ("num_hidden_layers", "sliding_window", "layer_types")}))
        return cls(name=name, layers=config["num_hidden_layers"], windows=tuple(windows) if any(windows) else (),
                   kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads, heads=heads,
                   hidden_size=config["hidden_size"], intermediate_size=config.get("intermediate_size"),
                   vocab_size=config.get("vocab_size"), tied_embeddings=bool(config.get("tie_word_embeddings")))


def load_shape(model: str) -> KVShape:
    """A checkpoint directory's config.json, or a model alias resolved as the workers resolve it."""
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        from splitserve.engine.model_loader import resolve_model  # imports torch; only needed for aliases
        path = resolve_model(model)
    return KVShape.from_config(model, json.loads((path / "config.json").read_text()))


def tp_refusal(shape: KVShape, tensor_parallel_size: int) -> str | None:
    """Why a worker would refuse this model at ``--tensor-parallel-size``, or None: each rank
    takes whole heads, so the attention and the KV heads must divide evenly."""
    for what, count in (("attention heads", shape.heads), ("KV heads", shape.kv_heads)):
        if count is not None and count % tensor_parallel_size:
            return (f"{shape.name} has {count} {what}, which do not split over {tensor_parallel_size} GPUs "
                    "(tensor parallelism needs both head counts divisible by it)")
    return None


def kv_bytes_per_token(shape: KVShape, dtype: str, kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1) -> int:
    """One token's KV on one GPU: a rank holds kv_heads / tensor_parallel_size of the heads; a
    quantized pool stores 1-byte codes and a float32 scale per (token, head) row."""
    quantized = kv_cache_dtype != "auto"
    return kv_sizes.kv_bytes_per_token(shape.layers, shape.kv_heads // tensor_parallel_size, shape.head_dim,
                                       1 if quantized else DTYPE_BYTES[dtype], quantized)


def pages_for(budget_gib: float, shape: KVShape, dtype: str, block_size: int, kv_cache_dtype: str = "auto",
              tensor_parallel_size: int = 1) -> int:
    """Pages a worker allocates for ``--kv-cache-memory-gb budget_gib`` (the engine's own
    arithmetic); with tensor parallelism the budget is each rank's, and every rank holds the same pages."""
    return kv_sizes.pages_for_budget(budget_gib, kv_bytes_per_token(shape, dtype, kv_cache_dtype, tensor_parallel_size),
                                     block_size)


pages_per_sequence = kv_sizes.pages_for_tokens


def weight_params(shape: KVShape) -> tuple[int, int] | None:
    """(parameters split across ranks, parameters every rank holds), or None when the shape lacks
    the sizes. Attention and MLP projections are split (splitserve/engine/config.py: heads and MLP columns);
    embeddings, the output head and norms are counted whole on every rank, the conservative side."""
    if None in (shape.heads, shape.hidden_size, shape.intermediate_size, shape.vocab_size):
        return None
    hidden = shape.hidden_size
    attention = 2 * hidden * shape.heads * shape.head_dim + 2 * hidden * shape.kv_heads * shape.head_dim  # q, o; k, v
    mlp = 3 * hidden * shape.intermediate_size  # gate, up, down
    embeddings = shape.vocab_size * hidden * (1 if shape.tied_embeddings else 2)
    norms = (2 * shape.layers + 1) * hidden
    return shape.layers * (attention + mlp), embeddings + norms


def weight_bytes_per_gpu(shape: KVShape, dtype: str, tensor_parallel_size: int = 1) -> int | None:
    params = weight_params(shape)
    if params is None:
        return None
    split, whole = params
    return (math.ceil(split / tensor_parallel_size) + whole) * DTYPE_BYTES[dtype]


def gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:,.1f} GiB"


def describe(shape: KVShape, dtype: str, kv_cache_dtype: str = "auto") -> list[str]:
    """The model lines every answer starts with: its KV shape, a token's KV, its weights when known."""
    per_token = kv_bytes_per_token(shape, dtype, kv_cache_dtype)
    dtype_name = "bfloat16" if dtype == "auto" else dtype
    if kv_cache_dtype == "auto":
        element = f"{dtype_name} ({DTYPE_BYTES[dtype]} B)"
        row = f"{shape.head_dim} x {DTYPE_BYTES[dtype]}"
    else:
        element = f"KV {kv_cache_dtype} (1 B, a {KV_SCALE_BYTES} B scale per token and head)"
        row = f"({shape.head_dim} + {KV_SCALE_BYTES}) x 1"
    lines = [f"model {shape.name}: {shape.layers} layers, {shape.kv_heads} KV heads, head size {shape.head_dim}, "
             f"{element}",
             f"KV bytes per token: 2 x {shape.layers} x {shape.kv_heads} x {row} "
             f"= {per_token:,} B ({per_token / 2**10:,.1f} KiB)"]
    params = weight_params(shape)
    if params is not None:
        count = sum(params)
        count_text = f"{count / 1e9:,.2f} billion" if count >= 1e9 else f"{count / 1e6:,.1f} million"
        lines.append(f"weights: {count_text} parameters = {gib(weight_bytes_per_gpu(shape, dtype))} in {dtype_name}")
    return lines


def report(shape: KVShape, dtype: str, block_size: int, budget_gib: float, context_lens: list[int],
           workers: int = 1, kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1) -> str:
    tp = tensor_parallel_size
    lines = describe(shape, dtype, kv_cache_dtype)
    per_gpu = " per GPU" if tp > 1 else ""
    if tp > 1:
        line = (f"tensor parallel {tp}: a worker on {tp} GPUs, each with {shape.kv_heads // tp} KV heads "
                f"({kv_bytes_per_token(shape, dtype, kv_cache_dtype, tp):,} B per token)")
        weights = weight_bytes_per_gpu(shape, dtype, tp)
        lines.append(line + (f" and {gib(weights)} of weights" if weights is not None else ""))
    per_page = kv_bytes_per_token(shape, dtype, kv_cache_dtype, tp) * block_size
    pages = pages_for(budget_gib, shape, dtype, block_size, kv_cache_dtype, tp)
    lines += [f"page of {block_size} tokens: {per_page:,} B{per_gpu}",
              f"pool of {budget_gib:g} GiB{per_gpu}: {pages:,} pages = {pages * block_size:,} tokens"]
    for n in context_lens:
        need = pages_per_sequence(n, block_size)
        seqs = pages // need
        line = f"context {n:,} tokens: {need:,} pages each -> {seqs:,} concurrent sequences"
        if workers > 1:
            line += f" per worker, {seqs * workers:,} on {workers} workers"
        lines.append(line)
    if shape.windows and tp == 1:
        lines += windowed_lines(shape, dtype, block_size, budget_gib, context_lens, kv_cache_dtype)
    return "\n".join(lines)


def windowed_lines(shape: KVShape, dtype: str, block_size: int, budget_gib: float, context_lens: list[int],
                   kv_cache_dtype: str = "auto", step_tokens: int = 2048) -> list[str]:
    """What a colocated worker makes of the budget when it frees windowed layers' pages: pages of
    one KV group's layers; a decoding sequence holds the full groups' pages and a window's worth
    (``kv_groups.window_pages``) per windowed group, and the pool keeps room for one step of
    ``--max-num-batched-tokens``' default in every windowed group (a prefill chunk's pages, given
    back behind the window after it)."""
    from dataclasses import replace

    from splitserve.engine.kv_groups import plan_groups, window_pages
    groups = plan_groups(list(shape.windows))
    per_page = kv_bytes_per_token(replace(shape, layers=groups.slots), dtype, kv_cache_dtype) * block_size
    pages = kv_sizes.pages_for_budget(budget_gib, per_page // block_size, block_size)
    windows = sorted(set(w for w in shape.windows if w))
    step_pages = sum(1 for w in groups.windows if w) * kv_sizes.pages_for_tokens(step_tokens, block_size)
    lines = [f"colocated, windowed layers' pages freed (windows {', '.join(map(str, windows))}; "
             f"{len(groups.windows)} groups of {groups.slots} layers): pages of {per_page:,} B, {pages:,} in the pool, "
             f"{step_pages:,} of them for a {step_tokens}-token step"]
    for n in context_lens:
        need = sum(window_pages(w, block_size, n, 1) for w in groups.windows)
        lines.append(f"  context {n:,} tokens: {need:,} pages each -> "
                     f"{max(0, pages - step_pages) // need:,} concurrent sequences")
    return lines


# ---- tensor-parallel sizes compared for a box of GPUs (--gpus) ----------------------------
#
# A layout is pairs of one prefill and one decode worker with the same ``--tensor-parallel-size N``
# (sides split differently re-shard KV by head, splitserve/kvtransfer/head_map.py; this sizing
# compares one N for both). A pair takes 2N GPUs, numbered as the
# workers number them: rank r of a worker on ``--device cuda:K`` runs on cuda:K+r. Each GPU holds
# its 1/N of the attention and MLP weights and a whole copy of the embeddings and norms
# (``weight_bytes_per_gpu``), keeps ``--overhead-gb`` for activations and the CUDA context,
# and gives the rest to its slice of the KV pool.
#
# The suggestion is the smallest N whose decode worker holds ``--min-sequences`` sequences of the
# longest context: a larger N buys KV room but spends more of every step on all-reduces and leaves
# fewer pairs to serve side by side.


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


def layout_report(shape: KVShape, dtype: str, kv_cache_dtype: str, block_size: int, gpus: int, gpu_memory_gib: float,
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m splitserve.cli.sizing",
                                description="KV pages and concurrent sequences for a KV memory budget")
    p.add_argument("--model", help="model alias or checkpoint directory (its config.json gives the shape)")
    p.add_argument("--name", default="custom", help="label for a shape given as numbers")
    p.add_argument("--layers", type=int, help="num_hidden_layers")
    p.add_argument("--kv-heads", type=int, help="num_key_value_heads")
    p.add_argument("--head-dim", type=int, help="head size (hidden_size / num_attention_heads unless set)")
    shape = p.add_argument_group("the rest of a shape given as numbers (tensor parallelism and weights)")
    shape.add_argument("--heads", type=int, help="num_attention_heads")
    shape.add_argument("--hidden-size", type=int, help="hidden_size")
    shape.add_argument("--intermediate-size", type=int, help="intermediate_size (the MLP's)")
    shape.add_argument("--vocab-size", type=int, help="vocab_size")
    shape.add_argument("--tied-embeddings", action="store_true", help="tie_word_embeddings (one matrix, not two)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES),
                   help="weights and KV pool dtype (the worker's --dtype)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV page format (the worker's --kv-cache-dtype); quantized ones size pages by it, not --dtype")
    p.add_argument("--block-size", type=int, default=16, help="tokens per page (the worker's --block-size)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0,
                   help="KV budget of one worker in GiB, of each of its GPUs with tensor parallelism "
                        "(the worker's --kv-cache-memory-gb)")
    p.add_argument("--context-len", type=int, nargs="+", default=[2048],
                   help="tokens per sequence (prompt + output) to count concurrent sequences for")
    p.add_argument("--workers", type=int, default=1, help="decode workers with this budget (prints the total)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs (ranks) per worker (the worker's --tensor-parallel-size)")
    box = p.add_argument_group("a box of GPUs: compare tensor-parallel sizes instead (needs the weights' shape)")
    box.add_argument("--gpus", type=int, help="GPUs on the box, shared by prefill + decode pairs")
    box.add_argument("--gpu-memory-gb", type=float, help="memory of one GPU in GiB")
    box.add_argument("--overhead-gb", type=float, default=8.0,
                     help="GiB of each GPU kept for activations, CUDA graphs and the CUDA context")
    box.add_argument("--min-sequences", type=int, default=8,
                     help="suggest the smallest size whose decode worker holds this many of the longest context")
    return p


def parse_shape(parser: argparse.ArgumentParser, args: argparse.Namespace) -> KVShape:
    numbers = (args.layers, args.kv_heads, args.head_dim)
    extra = dict(heads=args.heads, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                 vocab_size=args.vocab_size)
    if args.model and (any(v is not None for v in (*numbers, *extra.values())) or args.tied_embeddings):
        parser.error("give --model or the shape as numbers (--layers, --kv-heads, --head-dim...), not both")
    if args.model:
        try:
            return load_shape(args.model)
        except (FileNotFoundError, ValueError, KeyError) as e:
            parser.error(f"cannot read the shape of {args.model!r}: {e}")
    if not all(v is not None for v in numbers):
        parser.error("give --model, or all of --layers, --kv-heads and --head-dim")
    if any(v is not None and v < 1 for v in extra.values()):
        parser.error("--heads, --hidden-size, --intermediate-size and --vocab-size must be positive")
    return KVShape(args.name, *numbers, **extra, tied_embeddings=args.tied_embeddings)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    shape = parse_shape(parser, args)
    if min(shape.layers, shape.kv_heads, shape.head_dim, args.block_size, args.workers, args.tensor_parallel_size,
           args.min_sequences, *args.context_len) < 1:
        parser.error("layers, KV heads, head size, block size, workers, tensor-parallel size, minimum sequences "
                     "and context lengths must be positive")
    if not args.kv_cache_memory_gb > 0:
        parser.error("--kv-cache-memory-gb must be positive")
    if args.gpus is not None:
        if args.gpus < 2 or not (args.gpu_memory_gb or 0) > 0 or args.overhead_gb < 0:
            parser.error("--gpus needs at least 2 GPUs (a prefill and a decode worker), a positive --gpu-memory-gb "
                         "and a non-negative --overhead-gb")
        if weight_params(shape) is None:
            parser.error("comparing layouts needs the weights: give --model, or --heads, --hidden-size, "
                         "--intermediate-size and --vocab-size too")
        print(layout_report(shape, args.dtype, args.kv_cache_dtype, args.block_size, args.gpus,
                               args.gpu_memory_gb, args.overhead_gb, max(args.context_len), args.min_sequences))
        return 0
    refusal = tp_refusal(shape, args.tensor_parallel_size)
    if refusal:
        parser.error(refusal)
    print(report(shape, args.dtype, args.block_size, args.kv_cache_memory_gb, args.context_len, args.workers,
                 args.kv_cache_dtype, args.tensor_parallel_size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
