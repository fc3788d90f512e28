"""Conditional disaggregation under a mixed load: every prompt prefilled remotely (``--disaggregation
always``) vs decided per request (``auto``, and ``auto`` with its prefill-queue rule on,
``--prefill-queue-limit``), on one stack, same run.

A stack of one prefill and one decode worker (``--num-threads`` each) is fronted by one gateway
per arm; the arms take turns, round by round, the order turning each round. Each turn sends
``--requests`` requests at ``--rate`` per second (Poisson arrivals; the same arrival times and mix
for both arms of a round), drawn from three kinds, as a chat service sees them:

* ``short``: a fresh prompt of ``--short`` tokens (a range), a one-shot question;
* ``turn``: the next turn of one of ``--sessions`` conversations: its history (``--history``
  tokens at first, then growing by each turn and reply) plus ``--turn`` new tokens;
* ``long``: a fresh prompt of ``--long`` tokens, a document.

Each arm has prompts of its own (distinct tokens), so neither profits from the other's caches.
Per request, as the client sees it: TTFT (to the first token), TPOT (the mean gap after it),
where the prompt was prefilled (the timeline's prefill worker, empty when local). Per arm: TTFT
p50/p99 and TPOT p50/p99 over every turn but the first round's (which fills the caches), overall
and per kind.

    python -m bench.conditional_disagg --out bench/results/conditional_disagg.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench.common import percentile, write_json
from splitserve.client import Client
from tests.harness.stack import start_process, start_stack, stop_process

ARMS = ("always", "auto", "auto_queue")
KINDS = ("short", "turn", "long")


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def request(client: Client, prompt: list[int], max_tokens: int) -> dict:
    start = time.perf_counter()
    times, tokens, final = [], [], None
    for event in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=600):
        if event.token_ids:
            times.append(time.perf_counter())
            tokens += event.token_ids
        final = event if event.finished else final
    gaps = (times[-1] - times[0]) / (len(tokens) - 1) if len(tokens) > 1 else 0.0
    return {"ttft_ms": 1000 * (times[0] - start), "tpot_ms": 1000 * gaps, "tokens": tokens,
            "prompt_tokens": len(prompt), "cached_tokens": final.usage.cached_prompt_tokens,
            "local": not final.timeline.prefill_worker}


class Workload:
    """One arm's prompts: fresh ones from its own token range, and its sessions' histories."""

    def __init__(self, args, arm: int):
        self.args = args
        self.rng = random.Random(1000 + arm)
        self.histories = [self.tokens(args.history) for _ in range(args.sessions)]

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1000, 40000) for _ in range(n)]

    def prompt(self, kind: str, session: int) -> list[int]:
        if kind == "short":
            return self.tokens(self.rng.randint(*span(self.args.short)))
        if kind == "long":
            return self.tokens(self.rng.randint(*span(self.args.long)))
        return self.histories[session] + self.tokens(self.args.turn)


def plan_round(args, r: int) -> list[tuple[float, str, int]]:
    """(arrival offset s, kind, session) of each request of round ``r``: the same for both arms.
    A session has at most one turn a round, so its history grows turn by turn."""
    rng = random.Random(r)
    weights = [float(w) for w in args.mix.split(",")]
    sessions = list(range(args.sessions))
    rng.shuffle(sessions)
    out, t = [], 0.0
    for _ in range(args.requests):
        kind = rng.choices(KINDS, weights)[0]
        if kind == "turn" and not sessions:
            kind = "short"
        out.append((t, kind, sessions.pop() if kind == "turn" else -1))
        t += rng.expovariate(args.rate)
    return out


def run_turn(client: Client, workload: Workload, plan, args) -> list[dict]:
    rows: list[dict] = []
    lock = threading.Lock()

    def one(kind: str, session: int, prompt: list[int]) -> None:
        row = request(client, prompt, random.Random(len(prompt)).randint(*span(args.output)))
        if kind == "turn":
            workload.histories[session] = prompt + row["tokens"]
        row.pop("tokens")
        with lock:
            rows.append({**row, "kind": kind})
    threads, start = [], time.perf_counter()
    for offset, kind, session in plan:
        time.sleep(max(0.0, start + offset - time.perf_counter()))
        thread = threading.Thread(target=one, args=(kind, session, workload.prompt(kind, session)))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return rows


def summarize(rows: list[dict]) -> dict:
    def figures(subset: list[dict]) -> dict:
        if not subset:
            return {"requests": 0}
        ttft, tpot = [r["ttft_ms"] for r in subset], [r["tpot_ms"] for r in subset]
        return {"requests": len(subset), "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p99": percentile(ttft, 0.99),
                "tpot_ms_p50": statistics.median(tpot), "tpot_ms_p99": percentile(tpot, 0.99),
                "local_share": sum(r["local"] for r in subset) / len(subset)}
    return {"all": figures(rows), **{kind: figures([r for r in rows if r["kind"] == kind]) for kind in KINDS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-threads", type=int, default=1, help="per worker")
    parser.add_argument("--rate", type=float, default=1.5, help="requests per second")
    parser.add_argument("--requests", type=int, default=40, help="per arm and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--mix", default="5,3,2", help="weights of short, turn, long")
    parser.add_argument("--sessions", type=int, default=8, help="per arm")
    parser.add_argument("--short", default="16-96")
    parser.add_argument("--history", type=int, default=600)
    parser.add_argument("--turn", type=int, default=24)
    parser.add_argument("--long", default="500-900")
    parser.add_argument("--output", default="16-48", help="tokens generated per request (a range)")
    parser.add_argument("--local-prefill-tokens", type=int, default=256)
    parser.add_argument("--prefill-queue-limit", type=float, default=2.0,
                        help="the auto_queue arm's (the auto arm keeps the default, off)")
    parser.add_argument("--decode-target-tpot-ms", type=float, default=0.0,
                        help="the decode worker's --target-tpot-ms (0: none); it bounds the prompt share of its "
                             "steps, so what auto prefills there, and lowers auto's local limit")
    parser.add_argument("--out", default="bench/results/conditional_disagg.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ss-conditional-disagg-"))
    worker_args = ["--dtype", args.dtype, "--block-size", "16", "--num-gpu-blocks", "4096",
                   "--max-num-batched-tokens", "512", "--num-threads", str(args.num_threads)]
    gateway = ["--disaggregation", "always"]
    auto = {"auto": ["--disaggregation", "auto", "--local-prefill-tokens", str(args.local_prefill_tokens),
                     "--gateway-id", "gw-auto"],
            "auto_queue": ["--disaggregation", "auto", "--local-prefill-tokens", str(args.local_prefill_tokens),
                           "--prefill-queue-limit", str(args.prefill_queue_limit), "--gateway-id", "gw-auto-queue"]}
    rows: list[dict] = []
    decode_args = ["--target-tpot-ms", str(args.decode_target_tpot_ms)] if args.decode_target_tpot_ms else []
    with start_stack(args.model, work, prefill=1, decode=1, worker_defaults=worker_args, gateway_args=gateway,
                     role_args={"decode": decode_args}, metrics=False) as stack:
        gateways, clients = {}, {"always": stack.client}
        for arm, flags in auto.items():
            log = stack.log_dir / f"gateway-{arm}.log"
            gateways[arm], address = start_process([*stack.argv["gateway"], *flags], log)
            clients[arm] = Client(address)
        workloads = {arm: Workload(args, i) for i, arm in enumerate(ARMS)}
        try:
            for r in range(args.rounds):
                plan = plan_round(args, r)
                for arm in ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]:
                    turn_rows = run_turn(clients[arm], workloads[arm], plan, args)
                    rows += [{**row, "arm": arm, "round": r} for row in turn_rows]
                    print(f"round {r} {arm}:", json.dumps(summarize(turn_rows)["all"]), flush=True)
        finally:
            for arm, gateway in gateways.items():
                clients[arm].close()
                stop_process(gateway, stack.log_dir / f"gateway-{arm}.log")
    result = {"args": vars(args),
              "summary": {arm: summarize([row for row in rows if row["arm"] == arm and row["round"] > 0])
                          for arm in ARMS},
              "requests": rows}
    for arm in ARMS:
        print(arm, json.dumps(result["summary"][arm], indent=1))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
