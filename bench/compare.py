"""The serving comparisons of shared/BENCHMARKS.md, each one command, A/B interleaved in one run.

    python -m bench.compare disagg    # 1 prefill + 1 decode vs one 'both' worker, interference workload
    python -m bench.compare tpot-target  # one 'both' worker without vs with --target-tpot-ms, the same workload
    python -m bench.compare batching  # continuous vs static batching through the whole stack
    python -m bench.compare prefix    # prefix-cache hit vs miss TTFT through the whole stack
    python -m bench.compare overhead  # whole stack (gRPC + Redis + gateway) vs LLMEngine in-process
    python -m bench.compare http      # the same requests over gRPC and over the OpenAI HTTP API
    python -m bench.compare load      # TTFT/TPOT p50/p99 vs Poisson rate, disaggregated and colocated

Each writes ``bench/results/compare_<name>.json`` (``--out`` to change) and a PNG beside it.

Method: both systems are started side by side (each idle while the other is measured); each
round starts once the machine is quiet (``bench.common.wait_until_quiet``); a warm-up round of
each, then ``--pairs`` rounds A B A B ...; round i of A and round i of B get the same requests
at the same offsets; every round repeats the same lengths and offsets with
fresh prompt token ids, so no round finds an earlier round's prompts in the prefix cache.
Latencies are pooled over the measured rounds of a system (p50/p90/p99 over every request),
throughput = all output tokens / all wall time; per-round summaries, the gateway's own
timeline of each request (queued, prefill, KV transfer) and the machine's load average are
kept in the JSON. Metrics follow vLLM (see bench/serve.py). ``--quick`` is a smoke run (tiny
sizes, one pair).
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from bench.common import LoadSampler, median, wait_until_quiet, write_json
from bench.metrics import AIM, DEFINITIONS, metric_values
from bench.plots import plot_cdfs, plot_sweep
from splitserve.cli.loadgen import GrpcBackend, run_load, summarize
from bench.serve import meets_aim, relative_slo, summarize_rounds, sweep, unloaded
from splitserve.cli.launcher import UpProcess, running
from bench.stack import InProcessBackend
from splitserve.cli.workloads import BenchRequest, fresh_tokens, interference, mixed, poisson_offsets, prefix_probe

METHOD = ("systems side by side, one warm-up round each, then interleaved rounds A B A B ..., each started once the "
          "machine is quiet; the same requests "
          "and offsets in every round (fresh prompt ids each round); latencies pooled over the measured "
          "rounds, throughput = output tokens / wall time over them")

Phases = dict[str, tuple[list[dict], float]]  # phase name -> (request records, wall s) of one round


@dataclass(frozen=True)
class Round:
    index: int  # 0 is the warm-up; measured rounds are 1..pairs
    arm: str

    @property
    def warmup(self) -> bool:
        return self.index == 0


def schedule(arms: Sequence[str], pairs: int) -> list[Round]:
    """One warm-up round of every arm, then ``pairs`` rounds with the arms alternating."""
    if pairs < 1:
        raise ValueError(f"pairs must be >= 1, got {pairs}")
    if len(set(arms)) != len(arms) or len(arms) < 2:
        raise ValueError(f"need two or more distinct arms, got {list(arms)}")
    return [Round(i, arm) for i in range(pairs + 1) for arm in arms]


def ratio(a: float, b: float) -> float:
    return b / a if a else float("nan")


def run_interleaved(arms: dict[str, Callable[[int], Phases]], args) -> dict[str, dict[str, list]]:
    """Run the schedule (``args.pairs`` pairs; one with ``args.quick``, which also starts rounds
    without waiting for a quiet machine: a smoke run times nothing); returns arm -> phase ->
    [(records, wall) of each measured round]."""
    quick = getattr(args, "quick", False)
    runs: dict[str, dict[str, list]] = {arm: {} for arm in arms}
    for rnd in schedule(list(arms), 1 if quick else args.pairs):
        # The previous round's system may still be busy (bench.common.wait_until_quiet).
        waited = 0.0 if quick else wait_until_quiet()
        phases = arms[rnd.arm](rnd.index)
        for phase, (records, wall) in phases.items():
            s = summarize(records, wall, float("inf"), float("inf"))
            print(f"{'warm-up' if rnd.warmup else f'round {rnd.index}':8s} {rnd.arm:15s} {phase:9s} "
                  f"TTFT p50 {s['ttft_ms']['p50']:8.1f}  TPOT p50 {s['tpot_ms']['p50']:7.1f}  "
                  f"ITL p99 {s['itl_ms']['p99']:7.1f}  {s['output_tokens_per_s']:6.1f} tok/s  "
                  f"{wall:6.1f} s  failed {s['failed']}  retried {s['retried_requests']}  "
                  f"(waited {waited:.1f} s for a quiet machine)", flush=True)
            for error in s["errors"]:
                print(f"    error: {error[:300]}", flush=True)
            if not rnd.warmup:
                runs[rnd.arm].setdefault(phase, []).append((records, wall))
    return runs


def report(runs: dict[str, dict[str, list]], by_kind: bool = False) -> tuple[dict, dict]:
    """Pooled summary per arm and phase, and per-round summaries (for the spread)."""
    systems, per_round = {}, {}
    for arm, phases in runs.items():
        systems[arm] = {phase: summarize_rounds(rounds, by_kind=by_kind) for phase, rounds in phases.items()}
        per_round[arm] = {phase: [summarize(r, w, float("inf"), float("inf")) for r, w in rounds]
                          for phase, rounds in phases.items()}
        for phase, summaries in per_round[arm].items():
            systems[arm][phase]["median_round_output_tokens_per_s"] = median(
                [s["output_tokens_per_s"] for s in summaries])
    return systems, per_round


def pooled(runs, arm: str, phase: str) -> list[dict]:
    return [r for records, _ in runs[arm].get(phase, []) for r in records]


# ---- the systems -----------------------------------------------------------------------
def model_info(model: str) -> tuple[int, int]:
    from splitserve.engine.model_loader import load_config, resolve_model
    config = load_config(resolve_model(model))
    return config.vocab_size, getattr(config, "max_position_embeddings", 2048)


def engine_args(args) -> list[str]:
    out = ["--model", args.model, "--dtype", args.dtype, "--block-size", str(args.block_size),
           "--kv-cache-memory-gb", str(args.kv_cache_memory_gb)]
    if args.num_gpu_blocks:
        out += ["--num-gpu-blocks", str(args.num_gpu_blocks)]
    return out


def warmup_requests(vocab: int, seed: int) -> list[BenchRequest]:
    """A short warm-up round: four `mixed` prompts, at most 16 output tokens each."""
    return [BenchRequest(r.prompt_token_ids, min(r.max_tokens, 16)) for r in mixed(4, vocab, seed=seed + 10_000)]


DISAGG = ["--prefill", "1", "--decode", "1"]
COLOCATED = ["--prefill", "0", "--decode", "0"]


def write(args, name: str, payload: dict) -> Path:
    out = Path(args.out or f"bench/results/compare_{name}.json")
    config = {k: (v if v != float("inf") else "inf") for k, v in vars(args).items() if k not in ("func", "load")}
    extra = {"machine_load": args.load.summary()} if getattr(args, "load", None) else {}
    write_json(out, {"benchmark": f"compare_{name}", "definitions": DEFINITIONS, "method": METHOD,
                     "config": config, **payload, **extra})
    return out


# ---- the comparisons -------------------------------------------------------------------
def unloaded_then_poisson(args, vocab: int):
    """Rounds of two phases: ``--unloaded`` requests one at a time (64-token prompts, 32 output
    tokens), then ``--num-requests`` mixed ones at Poisson ``--rate``; the warm-up round is short.
    Returns ``phases(backend, round) -> Phases`` and (num_requests, unloaded, rate)."""
    n, n_unloaded, rate = (6, 2, 4.0) if args.quick else (args.num_requests, args.unloaded, args.rate)
    base_single = [BenchRequest(r.prompt_token_ids[:64], 32, "unloaded")
                   for r in mixed(n_unloaded, vocab, seed=args.seed + 500)]
    base = mixed(n, vocab, seed=args.seed)

    def phases(backend, i: int, arm: int = 0) -> Phases:
        """``arm``: arms that share one stack (and so its prefix cache) get the same lengths and
        arrival times but their own tokens, or the second would find the first's prompts cached."""
        requests = warmup_requests(vocab, args.seed) if i == 0 else base
        salt = 100_000 * arm
        return {"unloaded": run_load(backend, fresh_tokens(base_single, vocab, args.seed + salt + 500 + i)),
                "poisson": run_load(backend, fresh_tokens(requests, vocab, args.seed + salt + i),
                                    poisson_offsets(len(requests), rate, args.seed))}
    return phases, (n, n_unloaded, rate)


def cmd_disagg(args) -> int:
    return interference_comparison(args, "disagg", [UpProcess("disaggregated", [*engine_args(args), *DISAGG]),
                                                    UpProcess("colocated", [*engine_args(args), *COLOCATED])],
                                   "disaggregated (1 prefill + 1 decode) vs colocated (one 'both' worker)")


def cmd_tpot_target(args) -> int:
    """Colocated, with and without --target-tpot-ms: what holding TPOT costs the long prompts' TTFT."""
    target = ["--target-tpot-ms", f"{args.target_tpot_ms:g}"]
    return interference_comparison(args, "tpot_target", [
        UpProcess("colocated", [*engine_args(args), *COLOCATED]),
        UpProcess("target", [*engine_args(args), *COLOCATED, *target])],
        f"colocated, without and with --target-tpot-ms {args.target_tpot_ms:g}", extra={"target_tpot_ms":
                                                                                        args.target_tpot_ms})


def interference_comparison(args, name: str, stacks: list[Stack], title: str, extra: dict | None = None) -> int:
    """The interference workload on two stacks, interleaved; ratios are the second over the first."""
    vocab, max_len = model_info(args.model)
    lo, hi = (256, 384) if args.quick else (args.long_min, args.long_max)
    if hi + 8 > max_len:
        raise SystemExit(f"long prompts of up to {hi} tokens do not fit the model's {max_len} positions; "
                         "lower --long-max")
    n_dec, n_long, dec_tokens = (2, 1, 16) if args.quick else (args.decodes, args.long, args.decode_tokens)

    base, offsets = interference(n_dec, n_long, vocab, seed=args.seed, decode_tokens=dec_tokens, long_prompt=(lo, hi),
                                 long_start_s=args.long_start_s, long_every_s=args.long_every_s)

    def workload(i: int):
        if i == 0:  # warm-up: both paths once, short
            return interference(2, 1, vocab, seed=args.seed + 10_000, decode_tokens=8,
                                long_prompt=(lo // 2, lo // 2), long_start_s=0.2)
        return fresh_tokens(base, vocab, args.seed + i), offsets

    with running(stacks):
        backends = {s.name: GrpcBackend(s.address) for s in stacks}
        arms = {n: (lambda i, b=b: {"interference": run_load(b, *workload(i))}) for n, b in backends.items()}
        runs = run_interleaved(arms, args)
    systems, per_round = report(runs, by_kind=True)
    first, second = stacks[0].name, stacks[1].name
    a, b = (systems[s.name]["interference"]["by_kind"] for s in stacks)
    ratios = {f"{kind}_{m}_{q}_{second}_over_{first}": ratio(a[kind][f"{m}_ms"][q], b[kind][f"{m}_ms"][q])
              for kind, m, q in (("decode", "tpot", "p50"), ("decode", "tpot", "p99"), ("decode", "itl", "p99"),
                                 ("long", "ttft", "p50"))}
    out = write(args, name, {
        "workload": {"name": "interference", "decodes": n_dec, "decode_tokens": dec_tokens, "decode_prompt": [32, 64],
                     "long": n_long, "long_prompt": [lo, hi], "long_tokens": 8, "long_start_s": args.long_start_s,
                     "long_every_s": args.long_every_s},
        "commands": {s.name: " ".join(s.command) for s in stacks}, **(extra or {}),
        "systems": systems, "per_round": per_round, "ratios": ratios})
    print_ratios(ratios)
    records = {s.name: pooled(runs, s.name, "interference") for s in stacks}
    plot_cdfs([("ITL of the decoding requests", {n: metric_values(r, "itl", "decode") for n, r in records.items()}),
               ("TTFT of the long prompts", {n: metric_values(r, "ttft", "long") for n, r in records.items()})],
              out.with_suffix(".png"), f"{title}, interference workload")
    return 0


def cmd_batching(args) -> int:
    vocab, _ = model_info(args.model)
    n = 6 if args.quick else args.num_requests

    base = mixed(n, vocab, seed=args.seed)

    def workload(i: int):
        requests = warmup_requests(vocab, args.seed) if i == 0 else fresh_tokens(base, vocab, args.seed + i)
        return requests, poisson_offsets(len(requests), args.rate, args.seed)

    stacks = [UpProcess("continuous", [*engine_args(args), *COLOCATED, "--batching", "continuous"]),
              UpProcess("static", [*engine_args(args), *COLOCATED, "--batching", "static",
                               "--static-batch-size", str(args.static_batch_size)])]
    with running(stacks):
        backends = {s.name: GrpcBackend(s.address) for s in stacks}
        arms = {name: (lambda i, b=b: {"mixed": run_load(b, *workload(i))}) for name, b in backends.items()}
        runs = run_interleaved(arms, args)
    systems, per_round = report(runs)
    c, s = systems["continuous"]["mixed"], systems["static"]["mixed"]
    ratios = {"throughput_continuous_over_static": ratio(s["output_tokens_per_s"], c["output_tokens_per_s"]),
              "ttft_p50_static_over_continuous": ratio(c["ttft_ms"]["p50"], s["ttft_ms"]["p50"]),
              "e2e_p50_static_over_continuous": ratio(c["e2e_ms"]["p50"], s["e2e_ms"]["p50"])}
    out = write(args, "batching", {
        "workload": {"name": "mixed", "num_requests": n, "rate": "inf" if args.rate == float("inf") else args.rate},
        "commands": {st.name: " ".join(st.command) for st in stacks},
        "systems": systems, "per_round": per_round, "ratios": ratios})
    print_ratios(ratios)
    plot_cdfs([(m.upper(), {name: metric_values(pooled(runs, name, "mixed"), m) for name in backends})
               for m in ("ttft", "tpot", "e2e")],
              out.with_suffix(".png"), f"continuous vs static batching (B={args.static_batch_size}), "
                                       "one colocated worker, mixed workload")
    return 0


def cmd_prefix(args) -> int:
    vocab, max_len = model_info(args.model)
    prefix, hits = (96, 2) if args.quick else (args.prefix_tokens, args.hits)
    if prefix + 16 + 8 > max_len:
        raise SystemExit(f"a {prefix}-token prefix does not fit the model's {max_len} positions; lower --prefix-tokens")

    def probe(i: int):
        return prefix_probe(2 if i == 0 else hits, prefix, vocab, seed=args.seed + i)

    stack = UpProcess("stack", [*engine_args(args), *(COLOCATED if args.colocated else DISAGG)])
    with running([stack]):
        backend = GrpcBackend(stack.address)
        arms = {"hit": lambda i: {"sequential": run_load(backend, probe(i)["hit"])},
                "miss": lambda i: {"sequential": run_load(backend, probe(i)["miss"])}}
        runs = run_interleaved(arms, args)
    systems, per_round = report(runs, by_kind=True)
    kinds = {**systems["hit"]["sequential"]["by_kind"], **systems["miss"]["sequential"]["by_kind"]}
    ratios = {"ttft_p50_miss_over_hit": ratio(kinds["hit"]["ttft_ms"]["p50"], kinds["miss"]["ttft_ms"]["p50"]),
              "ttft_p50_first_over_hit": ratio(kinds["hit"]["ttft_ms"]["p50"], kinds["first"]["ttft_ms"]["p50"])}
    out = write(args, "prefix", {
        "workload": {"name": "prefix_probe", "prefix_tokens": prefix, "suffix_tokens": 16, "max_tokens": 8,
                     "hits_per_round": hits, "sent": "one at a time"},
        "commands": {"stack": " ".join(stack.command)},
        "systems": systems, "per_round": per_round, "ttft_ms_by_kind": {k: v["ttft_ms"] for k, v in kinds.items()},
        "ratios": ratios})
    print_ratios(ratios)
    records = pooled(runs, "hit", "sequential") + pooled(runs, "miss", "sequential")
    plot_cdfs([("TTFT", {k: metric_values(records, "ttft", k) for k in ("hit", "first", "miss")})],
              out.with_suffix(".png"), f"prefix cache: {prefix}-token shared prefix, hit vs miss")
    return 0


def cmd_overhead(args) -> int:
    from splitserve.engine.config import EngineConfig
    vocab, _ = model_info(args.model)
    phases, (n, n_unloaded, rate) = unloaded_then_poisson(args, vocab)

    stack = UpProcess("stack", [*engine_args(args), *(DISAGG if args.disagg else COLOCATED)])
    config = EngineConfig(model=args.model, dtype=args.dtype, block_size=args.block_size,
                          num_gpu_blocks=args.num_gpu_blocks or None, kv_cache_memory_gb=args.kv_cache_memory_gb)
    with running([stack]):
        grpc_backend = GrpcBackend(stack.address)
        local = InProcessBackend(config, num_threads=os.cpu_count() or 1)
        try:
            arms = {"stack": lambda i: phases(grpc_backend, i), "in_process": lambda i: phases(local, i)}
            runs = run_interleaved(arms, args)
        finally:
            local.close()
    systems, per_round = report(runs)
    st, ip = systems["stack"], systems["in_process"]
    diff = {f"{phase}_{m}_{q}_ms": st[phase][f"{m}_ms"][q] - ip[phase][f"{m}_ms"][q]
            for phase in ("unloaded", "poisson") for m in ("ttft", "tpot", "itl") for q in ("p50", "p99")}
    diff["poisson_output_tokens_per_s"] = st["poisson"]["output_tokens_per_s"] - ip["poisson"]["output_tokens_per_s"]
    ratios = {f"{phase}_{m}_p50_stack_over_in_process": ratio(ip[phase][f"{m}_ms"]["p50"], st[phase][f"{m}_ms"]["p50"])
              for phase, m in (("unloaded", "ttft"), ("poisson", "ttft"), ("poisson", "tpot"))}
    ratios["poisson_throughput_stack_over_in_process"] = ratio(ip["poisson"]["output_tokens_per_s"],
                                                               st["poisson"]["output_tokens_per_s"])
    out = write(args, "overhead", {
        "workload": {"unloaded": f"{n_unloaded} requests one at a time, 64-token prompts, 32 output tokens",
                     "poisson": {"name": "mixed", "num_requests": n, "rate": rate}},
        "commands": {"stack": " ".join(stack.command),
                     "in_process": f"engine.LLMEngine({config}) on an EngineLoop thread in the benchmark process, "
                                   f"{os.cpu_count()} torch threads (as `up` gives one colocated worker)"},
        "systems": systems, "per_round": per_round, "stack_minus_in_process": diff, "ratios": ratios})
    print_ratios({**ratios, **diff})
    plot_cdfs([(f"{m.upper()} ({phase})", {name: metric_values(pooled(runs, name, phase), m) for name in runs})
               for phase, m in (("unloaded", "ttft"), ("poisson", "ttft"), ("poisson", "itl"))],
              out.with_suffix(".png"), "whole stack (gRPC + Redis + gateway) vs LLMEngine in-process")
    return 0


def cmd_http(args) -> int:
    """The same requests through one stack's gRPC port and its OpenAI HTTP port, interleaved."""
    from bench.openai_client import OpenAIBackend
    vocab, _ = model_info(args.model)
    phases, (n, n_unloaded, rate) = unloaded_then_poisson(args, vocab)

    stack = UpProcess("stack", [*engine_args(args), *(DISAGG if args.disagg else COLOCATED)])
    with running([stack]):
        grpc_backend, http_backend = GrpcBackend(stack.address), OpenAIBackend(stack.http, args.model)
        try:
            runs = run_interleaved({"grpc": lambda i: phases(grpc_backend, i),
                                    "http": lambda i: phases(http_backend, i, arm=1)}, args)
        finally:
            http_backend.close()
    systems, per_round = report(runs)
    g, h = systems["grpc"], systems["http"]
    diff = {f"{phase}_{m}_{q}_ms": h[phase][f"{m}_ms"][q] - g[phase][f"{m}_ms"][q]
            for phase in ("unloaded", "poisson") for m in ("ttft", "tpot", "itl", "e2e") for q in ("p50", "p99")}
    diff["poisson_output_tokens_per_s"] = h["poisson"]["output_tokens_per_s"] - g["poisson"]["output_tokens_per_s"]
    out = write(args, "http", {
        "workload": {"unloaded": f"{n_unloaded} requests one at a time, 64-token prompts, 32 output tokens",
                     "poisson": {"name": "mixed", "num_requests": n, "rate": rate}},
        "commands": {"stack": " ".join(stack.command),
                     "grpc": "splitserve.client.Client.generate (token ids, greedy, ignore_eos)",
                     "http": "streamed POST /v1/completions (httpx; token ids, greedy, ignore_eos, return_token_ids)"},
        "systems": systems, "per_round": per_round, "http_minus_grpc": diff})
    print_ratios(diff)
    plot_cdfs([(f"{m.upper()} ({phase})", {name: metric_values(pooled(runs, name, phase), m) for name in runs})
               for phase, m in (("unloaded", "ttft"), ("poisson", "ttft"), ("poisson", "itl"))],
              out.with_suffix(".png"), "the same requests over gRPC and over the OpenAI HTTP API")
    return 0


def cmd_load(args) -> int:
    vocab, _ = model_info(args.model)
    rates = [2.0, 8.0] if args.quick else args.rates
    n = 6 if args.quick else args.num_requests
    layouts = {"disaggregated": DISAGG, "colocated": COLOCATED}
    names = [s.strip() for s in args.stacks.split(",")]
    unknown = set(names) - set(layouts)
    if unknown:
        raise SystemExit(f"unknown --stacks {sorted(unknown)}; choose from {sorted(layouts)}")
    stacks = [UpProcess(name, [*engine_args(args), *layouts[name]]) for name in names]
    with running(stacks):
        backends = {s.name: GrpcBackend(s.address) for s in stacks}
        warm = warmup_requests(vocab, args.seed)
        for backend in backends.values():
            run_load(backend, warm, [0.0] * len(warm))
        reference = unloaded(backends[names[0]], mixed(2 if args.quick else 4, vocab, seed=args.seed + 999))
        slo = relative_slo(reference)
        base = mixed(n, vocab, seed=args.seed)
        points = sweep(backends, rates, lambda i: fresh_tokens(base, vocab, args.seed + 1000 * (i + 1)), args.seed, slo)
    out = write(args, "load", {
        "workload": {"name": "mixed", "num_requests_per_rate": n, "rates": rates, "arrivals": "Poisson"},
        "commands": {s.name: " ".join(s.command) for s in stacks},
        "unloaded": reference, "slo": slo, "aim": AIM, "points": points,
        "meets_aim": {name: {str(p["rate"]): meets_aim(p["summary"]) for p in pts} for name, pts in points.items()}})
    plot_sweep(points, out.with_suffix(".png"),
               f"latency vs load through the whole stack — mixed workload, {n} requests per rate")
    return 0


def print_ratios(ratios: dict) -> None:
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")


# ---- command line ----------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="comparison", required=True)

    def add(name: str, func, help_: str, pairs: int = 3) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("--out", default="",
                       help=f"JSON file (default bench/results/compare_{name}.json); the PNG goes beside it")
        p.add_argument("--model", default="smollm2-135m-instruct")
        p.add_argument("--dtype", default="bfloat16")
        p.add_argument("--block-size", type=int, default=16)
        p.add_argument("--num-gpu-blocks", type=int, default=0,
                       help="KV pages per worker (0: sized from --kv-cache-memory-gb)")
        p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
        if pairs:
            p.add_argument("--pairs", type=int, default=pairs, help="measured A/B rounds after the warm-up")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, one pair")
        p.set_defaults(func=func)
        return p

    def interference_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--decodes", type=int, default=6, help="short requests decoding from t=0")
        p.add_argument("--decode-tokens", type=int, default=96)
        p.add_argument("--long", type=int, default=2, help="long prompts arriving while they decode")
        p.add_argument("--long-min", type=int, default=1024)
        p.add_argument("--long-max", type=int, default=2048)
        p.add_argument("--long-start-s", type=float, default=1.0)
        p.add_argument("--long-every-s", type=float, default=3.0)

    interference_args(add("disagg", cmd_disagg,
                          "disaggregated (1 prefill + 1 decode) vs colocated ('both') under interference"))
    p = add("tpot-target", cmd_tpot_target, "colocated without vs with --target-tpot-ms under interference")
    interference_args(p)
    p.add_argument("--target-tpot-ms", type=float, default=60.0)

    p = add("batching", cmd_batching, "continuous vs static batching through the whole stack (one 'both' worker)")
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--rate", type=float, default=float("inf"), help="Poisson requests/s; inf = all at t=0")
    p.add_argument("--static-batch-size", type=int, default=8)

    p = add("prefix", cmd_prefix, "prefix-cache hit vs miss TTFT through the whole stack", pairs=5)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--hits", type=int, default=4, help="requests per round that share the round's prefix")
    p.add_argument("--colocated", action="store_true", help="one 'both' worker instead of 1 prefill + 1 decode")

    p = add("overhead", cmd_overhead, "whole stack (gRPC + Redis + gateway) vs LLMEngine in-process")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson requests/s of the loaded phase")
    p.add_argument("--unloaded", type=int, default=3, help="requests sent one at a time before the loaded phase")
    p.add_argument("--disagg", action="store_true", help="stack of 1 prefill + 1 decode instead of one 'both' worker")

    p = add("http", cmd_http, "the same requests over gRPC and over the OpenAI-compatible HTTP API of one stack")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson requests/s of the loaded phase")
    p.add_argument("--unloaded", type=int, default=3, help="requests sent one at a time before the loaded phase")
    p.add_argument("--disagg", action="store_true", help="stack of 1 prefill + 1 decode instead of one 'both' worker")

    p = add("load", cmd_load, "latency vs load: TTFT/TPOT p50/p99 at several Poisson rates", pairs=0)
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1.0, 2.0, 4.0])
    p.add_argument("--num-requests", type=int, default=20, help="requests per rate")
    p.add_argument("--stacks", default="disaggregated,colocated", help="comma list: disaggregated, colocated")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    args.load = LoadSampler().start()
    try:
        code = args.func(args)
    finally:
        args.load.stop()
    load = args.load.summary()
    print(f"{args.comparison}: {time.perf_counter() - start:.0f} s; load average {load['loadavg_1min_mean']:.1f} "
          f"(max {load['loadavg_1min_max']:.1f}) on {load['cores']} cores", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
