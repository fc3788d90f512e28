"""Roles that follow the load: a fixed prefill:decode split vs ``up --role-controller``, under a
workload whose mix changes halfway; goodput as DistServe defines it (requests per second that
meet both a TTFT and a TPOT SLO).

Each run starts ``splitserve up`` with one prefill and one decode worker (``--num-threads`` each,
``--disaggregation auto``, so decode workers alone can serve) and sends, at Poisson arrivals:

* phase 1 (``--phase-s`` seconds): prompt-heavy, long prompts (``--long``) and short outputs;
* phase 2 (as long): decode-heavy, short prompts (``--short``) and long outputs (``--output``).

The ``fixed`` arm keeps its split; the ``controller`` arm runs ``--role-controller`` with the SLO
as its targets (``--min-prefill-workers 0``). Arms alternate, the order turning each round (one
stack at a time: on a small box two would share its cores). Per request, as the client sees it:
TTFT, TPOT, whether it met the SLO; per arm and phase: goodput and the latency percentiles; per
controller run, the moves ``up`` logged and when.

    python -m bench.role_controller --out bench/results/role_controller.json
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench.common import percentile, write_json
from bench.conditional_disagg import request, span
from tests.harness.up import start_up

ARMS = ("fixed", "controller")
PHASES = ("prompt_heavy", "decode_heavy")


def up_args(args, arm: str) -> list[str]:
    out = ["--model", args.model, "--dtype", args.dtype, "--prefill", "1", "--decode", "1",
           "--num-threads", str(args.num_threads), "--block-size", "16", "--max-num-batched-tokens", "512",
           "--disaggregation", "auto", "--drain-timeout-s", "30"]
    if arm == "controller":
        out += ["--role-controller", "--min-prefill-workers", "0", "--role-ttft-target-ms", str(args.slo_ttft_ms),
                "--role-tpot-target-ms", str(args.slo_tpot_ms), "--role-check-interval-s", str(args.check_s),
                "--role-change-interval-s", str(args.change_s)]
    return out


def run_arm(args, arm: str, work: Path, seed: int) -> dict:
    rows: list[dict] = []
    lock = threading.Lock()
    rng = random.Random(seed)
    log_dir = work / f"{arm}-{seed}"
    log_dir.mkdir(parents=True, exist_ok=True)
    with start_up(up_args(args, arm), log_dir) as up:
        start = time.perf_counter()

        def one(phase: str, prompt: list[int], max_tokens: int) -> None:
            sent = time.perf_counter() - start
            try:
                row = request(up.client, prompt, max_tokens)
                row.pop("tokens")
            except Exception as e:  # noqa: BLE001 - a failed request misses the SLO, and is counted
                row = {"error": f"{type(e).__name__}: {e}"}
            with lock:
                rows.append({**row, "phase": phase, "sent_s": sent})
        threads = []
        for phase in PHASES:
            rate = args.rate_1 if phase == PHASES[0] else args.rate_2
            end = time.perf_counter() + args.phase_s
            while time.perf_counter() < end:
                n = rng.randint(*span(args.long if phase == PHASES[0] else args.short))
                prompt = [rng.randrange(1000, 40000) for _ in range(n)]
                tokens = rng.randint(*span(args.output_1 if phase == PHASES[0] else args.output))
                thread = threading.Thread(target=one, args=(phase, prompt, tokens))
                thread.start()
                threads.append(thread)
                time.sleep(rng.expovariate(rate))
        for thread in threads:
            thread.join()
        moves = [{"line": m.group(0)} for m in re.finditer(r"role controller: \S+ becomes a \S+ worker: [^\n]*",
                                                               up.log())]
    return {"arm": arm, "seed": seed, "rows": rows, "moves": moves, "duration_s": 2 * args.phase_s}


def summarize(rows: list[dict], seconds: float, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    done = [r for r in rows if "error" not in r]
    good = [r for r in done if r["ttft_ms"] <= slo_ttft_ms and r["tpot_ms"] <= slo_tpot_ms]
    out = {"requests": len(rows), "errors": len(rows) - len(done), "goodput_rps": len(good) / seconds,
           "slo_attainment": len(good) / len(rows) if rows else 0.0}
    if done:
        ttft, tpot = [r["ttft_ms"] for r in done], [r["tpot_ms"] for r in done]
        out.update(ttft_ms_p50=statistics.median(ttft), ttft_ms_p99=percentile(ttft, 0.99),
                   tpot_ms_p50=statistics.median(tpot), tpot_ms_p99=percentile(tpot, 0.99))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-threads", type=int, default=1, help="per worker")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--phase-s", type=float, default=90.0)
    parser.add_argument("--rate-1", type=float, default=0.8, help="requests/s, prompt-heavy phase")
    parser.add_argument("--rate-2", type=float, default=1.5, help="requests/s, decode-heavy phase")
    parser.add_argument("--long", default="500-900", help="prompt tokens, prompt-heavy phase")
    parser.add_argument("--output-1", default="4-16", help="output tokens, prompt-heavy phase")
    parser.add_argument("--short", default="16-64", help="prompt tokens, decode-heavy phase")
    parser.add_argument("--output", default="100-200", help="output tokens, decode-heavy phase")
    parser.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=60.0)
    parser.add_argument("--check-s", type=float, default=3.0, help="the controller's --role-check-interval-s")
    parser.add_argument("--change-s", type=float, default=30.0, help="the controller's --role-change-interval-s")
    parser.add_argument("--out", default="bench/results/role_controller.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ss-role-controller-"))
    runs = []
    for r in range(args.rounds):
        for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
            run = run_arm(args, arm, work, seed=r)
            runs.append(run)
            phases = {p: summarize([x for x in run["rows"] if x["phase"] == p], args.phase_s, args.slo_ttft_ms,
                                   args.slo_tpot_ms) for p in PHASES}
            print(f"round {r} {arm}: moves {[m['line'] for m in run['moves']]}", json.dumps(phases), flush=True)
    summary = {}
    for arm in ARMS:
        mine = [run for run in runs if run["arm"] == arm]
        rows = [row for run in mine for row in run["rows"]]
        seconds = sum(run["duration_s"] for run in mine)
        summary[arm] = {"all": summarize(rows, seconds, args.slo_ttft_ms, args.slo_tpot_ms),
                        **{p: summarize([x for x in rows if x["phase"] == p], seconds / 2, args.slo_ttft_ms,
                                        args.slo_tpot_ms) for p in PHASES}}
    for arm in ARMS:
        print(arm, json.dumps(summary[arm], indent=1))
    write_json(args.out, {"args": vars(args), "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
