"""``splitserve tune``: the configuration that serves the most requests per second within an SLO.

For every point of a grid (``max_num_seqs`` x ``max_num_batched_tokens`` x block size x the
prefill:decode split) it starts a ``splitserve up`` stack and finds the highest Poisson request
rate at which TTFT p99 and TPOT p50 still meet the SLO and nothing fails: the point's
*goodput*. The rate search doubles from ``--start-rate`` until the SLO breaks (or halves it until it
holds), then bisects (geometric means) ``--search-steps`` times between the last pass and the
first failure.
Every probe sends the same request lengths with fresh prompt ids, so no probe finds the last
one's prompts in the prefix cache.

Writes ``tune.json`` (the SLO, every probe of every point, the best), ``tune.png`` and the
best point as a config file (``tuned.yaml``) that ``up``, the gateway and the workers read with
``--config``. ``--address`` measures the goodput of a stack that is already running instead
(its configuration is its own: nothing is swept, no config file is written).

A split is ``colocated`` (one worker doing both), ``P:D`` (P prefill and D decode workers, the
cores split evenly) or ``P:D@p:d`` (p torch threads per prefill worker, d per decode worker).
On a GPU, ``P:D`` is the number of workers sharing it (``up`` splits its memory).
"""
from __future__ import annotations

import json
import re
import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from splitserve.cli.loadgen import GrpcBackend, run_load, summarize
from splitserve.cli.workloads import BenchRequest, fresh_tokens, mixed, poisson_offsets


@dataclass(frozen=True)
class Split:
    prefill: int
    decode: int
    prefill_threads: int = 0  # 0: up's even split of the cores
    decode_threads: int = 0

    @classmethod
    def parse(cls, text: str) -> "Split":
        text = text.strip()
        if text == "colocated":
            return cls(0, 0)
        match = re.fullmatch(r"(\d+):(\d+)(?:@(\d+):(\d+))?", text)
        if not match or (int(match[1]) == 0) != (int(match[2]) == 0):
            raise ValueError(f"a split is 'colocated', 'P:D' or 'P:D@p:d' with P, D >= 1, got {text!r}")
        return cls(int(match[1]), int(match[2]), int(match[3] or 0), int(match[4] or 0))

    def __str__(self) -> str:
        if not self.prefill:
            return "colocated"
        threads = f"@{self.prefill_threads}:{self.decode_threads}" if self.prefill_threads or self.decode_threads \
            else ""
        return f"{self.prefill}:{self.decode}{threads}"


@dataclass(frozen=True)
class Point:
    """One configuration of the grid."""
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    split: Split

    def config(self) -> dict:
        """Its flags, as a config file holds them."""
        out = {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
               "block_size": self.block_size, "prefill": self.split.prefill, "decode": self.split.decode}
        if self.split.prefill_threads:
            out["prefill_threads"] = self.split.prefill_threads
        if self.split.decode_threads:
            out["decode_threads"] = self.split.decode_threads
        return out

    def up_args(self) -> list[str]:
        return [arg for key, value in self.config().items() for arg in ("--" + key.replace("_", "-"), str(value))]

    def __str__(self) -> str:
        return (f"seqs={self.max_num_seqs} tokens={self.max_num_batched_tokens} block={self.block_size} "
                f"split={self.split}")


def grid(seqs: Sequence[int], tokens: Sequence[int], blocks: Sequence[int], splits: Sequence[Split]) -> list[Point]:
    return [Point(s, t, b, sp) for sp in splits for b in blocks for t in tokens for s in seqs]


# ---- the rate search -----------------------------------------------------------------------

def meets(summary: dict, slo: dict) -> bool:
    return summary["failed"] == 0 and summary["ttft_ms"]["p99"] <= slo["ttft_p99_ms"] \
        and summary["tpot_ms"]["p50"] <= slo["tpot_p50_ms"]


# Below a start rate that already breaks the SLO, how many times the search halves it.
HALVINGS = 4


def max_probes(start_rate: float, max_rate: float, steps: int) -> int:
    """The most probes one point's search may take (the progress bar's share of a point)."""
    doublings = 0
    rate = start_rate
    while rate < max_rate:
        rate *= 2
        doublings += 1
    return 1 + max(doublings, HALVINGS) + steps


def highest_rate(probe: Callable[[float], dict], slo: dict, start_rate: float, max_rate: float,
                 steps: int) -> tuple[float, list[dict]]:
    """The highest rate (req/s) whose probe meets ``slo``, and every probe as ``{"rate", "meets",
    "summary"}``: from ``start_rate`` it doubles while the SLO holds (up to ``max_rate``), or halves
    until it holds (0 when even ``start_rate / 2**HALVINGS`` breaks it), then bisects ``steps`` times."""
    probes: list[dict] = []

    def run(rate: float) -> bool:
        summary = probe(rate)
        probes.append({"rate": rate, "meets": meets(summary, slo), "summary": summary})
        return probes[-1]["meets"]

    passed, failed = 0.0, start_rate
    if run(start_rate):
        passed = start_rate
        while passed < max_rate:
            rate = min(passed * 2, max_rate)
            if not run(rate):
                failed = rate
                break
            passed = rate
        else:
            return passed, probes
    else:
        for _ in range(HALVINGS):
            rate = failed / 2
            if run(rate):
                passed = rate
                break
            failed = rate
        else:
            return 0.0, probes
    for _ in range(steps):
        rate = (passed * failed) ** 0.5
        if run(rate):
            passed = rate
        else:
            failed = rate
    return passed, probes


# ---- measuring a stack -----------------------------------------------------------------------

def load_workload(path: str, model: str) -> list[BenchRequest]:
    """A JSONL workload: one request a line, ``prompt`` (text) or ``prompt_token_ids``, and ``max_tokens``."""
    tokenizer = None
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            max_tokens = int(row["max_tokens"])
            if "prompt_token_ids" in row:
                ids = [int(t) for t in row["prompt_token_ids"]]
            else:
                if tokenizer is None:
                    from splitserve.engine.model_loader import load_tokenizer, resolve_model
                    tokenizer = load_tokenizer(resolve_model(model))
                ids = tokenizer.encode(str(row["prompt"]))
        except (ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"{path}:{number}: a request needs prompt or prompt_token_ids, and max_tokens ({e})")
        if not ids or max_tokens < 1:
            raise SystemExit(f"{path}:{number}: empty prompt or max_tokens < 1")
        requests.append(BenchRequest(ids, max_tokens))
    if not requests:
        raise SystemExit(f"{path} holds no request")
    return requests


class Prober:
    """Sends a workload at a rate to one gateway and summarizes it against the SLO."""

    def __init__(self, backend: GrpcBackend, requests: list[BenchRequest], vocab: int, slo: dict, seed: int,
                 fresh: bool):
        self.backend, self.requests, self.vocab, self.slo, self.seed = backend, requests, vocab, slo, seed
        self.fresh = fresh  # synthetic prompts get new ids every probe; a user's file is sent as it is
        self.count = 0

    def warm_up(self) -> None:
        warm = [BenchRequest(r.prompt_token_ids, min(r.max_tokens, 16)) for r in self.requests[:4]]
        run_load(self.backend, fresh_tokens(warm, self.vocab, self.seed + 99_999) if self.fresh else warm,
                 [0.0] * len(warm))

    def __call__(self, rate: float) -> dict:
        self.count += 1
        requests = fresh_tokens(self.requests, self.vocab, self.seed + self.count) if self.fresh else self.requests
        results, wall = run_load(self.backend, requests, poisson_offsets(len(requests), rate, self.seed))
        return summarize(results, wall, self.slo["ttft_p99_ms"], self.slo["tpot_p50_ms"])


def tune_point(point: Point | None, measure: Callable[[Callable[[float], dict]], tuple[float, list[dict]]],
               make_prober: Callable[[str], Prober], stack_args: list[str]) -> dict:
    """Start the point's stack (or use the running one when ``point`` is None), search its rate."""
    from splitserve.cli.launcher import UpProcess, running
    if point is None:
        prober = make_prober("")
        prober.warm_up()
        best, probes = measure(prober)
        return {"point": None, "goodput_requests_per_s": best, "probes": probes}
    stack = UpProcess("tune", [*stack_args, *point.up_args()])
    started = time.monotonic()
    with running([stack]):
        boot_s = time.monotonic() - started
        prober = make_prober(stack.address)
        try:
            prober.warm_up()
            best, probes = measure(prober)
        finally:
            prober.backend.close()
    return {"point": {**asdict(point), "split": str(point.split)}, "config": point.config(),
            "command": " ".join(stack.command), "boot_s": boot_s, "goodput_requests_per_s": best, "probes": probes}


def best_of(results: list[dict]) -> dict | None:
    """The point with the highest goodput; among equals the first (the grid lists smaller first)."""
    scored = [r for r in results if r["goodput_requests_per_s"] > 0]
    return max(scored, key=lambda r: r["goodput_requests_per_s"]) if scored else None


def plot(results: list[dict], slo: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (bars, ttft, tpot) = plt.subplots(1, 3, figsize=(17, 4.8))
    labels = [str(Point(**{**r["point"], "split": Split.parse(r["point"]["split"])})) if r["point"] else "running stack"
              for r in results]
    bars.barh(range(len(results)), [r["goodput_requests_per_s"] for r in results])
    bars.set_yticks(range(len(results)), labels, fontsize=7)
    bars.set_xlabel("goodput (req/s within the SLO)")
    for label, r in zip(labels, results):
        probes = sorted(r["probes"], key=lambda p: p["rate"])
        rates = [p["rate"] for p in probes]
        ttft.plot(rates, [p["summary"]["ttft_ms"]["p99"] for p in probes], marker="o", label=label)
        tpot.plot(rates, [p["summary"]["tpot_ms"]["p50"] for p in probes], marker="o", label=label)
    for ax, key, name in ((ttft, "ttft_p99_ms", "TTFT p99 (ms)"), (tpot, "tpot_p50_ms", "TPOT p50 (ms)")):
        ax.axhline(slo[key], color="k", linestyle="--", linewidth=1, label="SLO")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    tpot.legend(fontsize=6)
    fig.suptitle(f"splitserve tune: TTFT p99 <= {slo['ttft_p99_ms']:g} ms, TPOT p50 <= {slo['tpot_p50_ms']:g} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cmd_tune(args) -> int:
    from tqdm import tqdm

    from splitserve.cli import config_file
    if args.mixed and args.workload:
        raise SystemExit("splitserve tune: --mixed or --workload, not both")
    slo = {"ttft_p99_ms": args.slo_ttft_p99_ms, "tpot_p50_ms": args.slo_tpot_p50_ms}
    vocab = _vocab_size(args.model)
    requests = load_workload(args.workload, args.model) if args.workload else \
        mixed(args.num_requests, vocab, seed=args.seed)
    try:
        splits = [Split.parse(s) for s in args.splits.split(",")]
        points: list[Point | None] = [None] if args.address else \
            grid(_ints(args.max_num_seqs), _ints(args.max_num_batched_tokens), _ints(args.block_size), splits)
        from splitserve.engine.config import EngineConfig
        for point in filter(None, points):  # a value the engine refuses stops here, not in a stack's log
            EngineConfig(max_num_seqs=point.max_num_seqs, max_num_batched_tokens=point.max_num_batched_tokens,
                         block_size=point.block_size)
    except ValueError as e:
        raise SystemExit(f"splitserve tune: {e}")
    per_point = max_probes(args.start_rate, args.max_rate, args.search_steps)
    bar = tqdm(total=len(points) * per_point, desc="tune", unit="probe")

    def make_prober(address: str) -> Prober:
        return Prober(GrpcBackend(address or args.address), requests, vocab, slo, args.seed, fresh=not args.workload)

    stack_args = ["--model", args.model, "--dtype", args.dtype, *shlex.split(args.up_args)]
    out = Path(args.out)
    results: list[dict] = []
    for point in points:
        bar.set_postfix_str(str(point) if point else args.address)

        def measure(prober: Prober) -> tuple[float, list[dict]]:
            def probe(rate: float) -> dict:
                summary = prober(rate)
                bar.update(1)
                return summary
            return highest_rate(probe, slo, args.start_rate, args.max_rate, args.search_steps)
        done = bar.n
        result = tune_point(point, measure, make_prober, stack_args)
        bar.update(done + per_point - bar.n)  # a search that ended early gives back its share
        results.append(result)
        tqdm.write(f"{point or args.address}: goodput {result['goodput_requests_per_s']:.3g} req/s "
                   f"({len(result['probes'])} probes)")
        _write(out, args, slo, results)  # every point as soon as it is measured: a long run can be cut
    bar.close()
    best = best_of(results)
    payload = _write(out, args, slo, results)
    try:
        plot(results, slo, out / "tune.png")
        print(f"wrote {out / 'tune.png'}")
    except ImportError:  # the plot is optional: pip install 'splitserve[tune]'
        print("no tune.png: matplotlib is not installed (pip install 'splitserve[tune]')")
    if best is None:
        print("no point met the SLO at any rate tried: loosen it or lower --start-rate")
        return 1
    if best["point"] is not None:
        header = (f"splitserve tune, {time.strftime('%Y-%m-%d %H:%M')}: {best['goodput_requests_per_s']:.3g} req/s "
                  f"within TTFT p99 <= {slo['ttft_p99_ms']:g} ms and TPOT p50 <= {slo['tpot_p50_ms']:g} ms\n"
                  f"model {args.model}, {payload['workload']}; every point: {out / 'tune.json'}\n"
                  f"use: splitserve up --config {args.config_out or out / 'tuned.yaml'}")
        config_path = Path(args.config_out or out / "tuned.yaml")
        config_path.parent.mkdir(parents=True, exist_ok=True)
        config_path.write_text(config_file.dump({"model": args.model, "dtype": args.dtype, **best["config"]},
                                                header))
        print(f"best: {Point(**{**best['point'], 'split': Split.parse(best['point']['split'])})}, "
              f"{best['goodput_requests_per_s']:.3g} req/s; wrote {config_path}")
    else:
        print(f"goodput of {args.address}: {best['goodput_requests_per_s']:.3g} req/s")
    return 0


def _write(out: Path, args, slo: dict, results: list[dict]) -> dict:
    best = best_of(results)
    payload = {"benchmark": "tune", "slo": slo,
               "workload": f"{args.workload} (as is)" if args.workload else
               f"mixed, {args.num_requests} requests a probe (fresh prompt ids each)",
               "search": {"start_rate": args.start_rate, "max_rate": args.max_rate, "steps": args.search_steps},
               "points": results, "best": best and {k: best[k] for k in ("point", "goodput_requests_per_s")}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps({**payload, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
                                              indent=2) + "\n")
    return payload


def _vocab_size(model: str) -> int:
    """The model's vocabulary (the synthetic prompts draw token ids from it)."""
    from splitserve.engine.model_loader import load_config, resolve_model
    return load_config(resolve_model(model)).vocab_size


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected a comma list of integers, got {text!r}") from None
    if not values:
        raise ValueError(f"expected a comma list of integers, got {text!r}")
    return values
