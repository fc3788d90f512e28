"""Multi-turn sessions through a served stack: placement by the prefix directory vs by load alone,
with the host KV tier on and off.

A stack of two colocated workers (``--role both``, one thread each) serves ``--sessions`` chat
sessions per arm. Each session starts from a history of ``--history`` random tokens behind a
system prompt of ``--system`` tokens that every session shares; every round it sends its history
plus ``--turn`` new tokens and gets ``--reply`` greedy tokens, which (with the turn) join its
history. A worker's pool (``--pool-tokens``) holds about one history, so sessions push each
other's pages out of the device; with the tier (``--offload-gb`` per worker) they stay in host
memory.

Two gateways front the one stack: the stack's own (``--prefix-routing directory``) and a second
with ``--prefix-routing load``. Each arm has sessions of its own (distinct histories, so neither
profits from the other's caches) and the arms take turns, round by round, alternating which goes
first; within an arm's turn its sessions send at once, in a random order. Per request: TTFT as the client sees it
(to the first token), the prompt tokens served from cache (the gateway's usage), the worker;
per arm's turn, the pages each worker's tier loaded (its metrics). The tier-off and tier-on
stacks run one after the other (their workers' flags differ).

    python -m bench.prefix_routing --out bench/results/prefix_routing.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path

from bench.common import percentile, write_json
from splitserve.client import Client
from tests.harness.stack import start_process, start_stack, stop_process
from tests.harness.tools import scrape

ARMS = ("directory", "load")


def turn(client: Client, prompt: list[int], reply: int) -> dict:
    start = time.perf_counter()
    ttft, tokens, final = None, [], None
    for event in client.generate(prompt, max_tokens=reply, temperature=0.0, ignore_eos=True, timeout=600):
        if event.token_ids and ttft is None:
            ttft = time.perf_counter() - start
        tokens += event.token_ids
        final = event if event.finished else final
    return {"ttft_ms": 1000 * ttft, "tokens": tokens, "prompt_tokens": len(prompt),
            "cached_tokens": final.usage.cached_prompt_tokens, "worker": final.timeline.decode_worker}


def tier_pages(stack) -> dict[str, float]:
    """Pages the workers' host and disk tiers loaded so far, over all workers."""
    out = {"host": 0.0, "disk": 0.0}
    for name, port in stack.metrics_ports.items():
        if stack.roles.get(name) is None:
            continue
        for key, value in scrape(port).items():
            for tier in out:
                if key == f"splitserve:kv_offload_pages_total{{op=loaded,tier={tier}}}":
                    out[tier] += value
    return out


def run_stack(args, tiers_on: bool, work: Path) -> dict:
    pool_blocks = args.pool_tokens // 16
    worker_args = ["--dtype", args.dtype, "--block-size", "16", "--num-gpu-blocks", str(pool_blocks),
                   "--max-num-batched-tokens", "512", "--num-threads", "1",
                   *(["--kv-offloading-size", str(args.offload_gb)] if tiers_on else [])]
    rng = random.Random(0)
    system = [rng.randrange(1000, 40000) for _ in range(args.system)]
    histories = {arm: [system + [rng.randrange(1000, 40000) for _ in range(args.history)]
                       for _ in range(args.sessions)] for arm in ARMS}
    last_worker: dict[tuple[str, int], str] = {}
    rows: list[dict] = []
    loaded = {arm: {"host": 0.0, "disk": 0.0} for arm in ARMS}
    with start_stack(args.model, work / ("tiers-on" if tiers_on else "tiers-off"), prefill=0, decode=0, both=2,
                     worker_defaults=worker_args) as stack:
        load_gateway, address = start_process([*stack.argv["gateway"], "--gateway-id", "gw-load",
                                               "--prefix-routing", "load"], stack.log_dir / "gateway-load.log")
        clients = {"directory": stack.client, "load": Client(address)}
        try:
            for r in range(args.rounds):
                for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                    before = tier_pages(stack)
                    results: dict[int, dict] = {}

                    def session(s: int, arm=arm, results=results) -> None:
                        turn_tokens = [rng_turn.randrange(1000, 40000) for _ in range(args.turn)]
                        prompt = histories[arm][s] + turn_tokens
                        results[s] = turn(clients[arm], prompt, args.reply)
                        histories[arm][s] = prompt + results[s]["tokens"]
                    rng_turn = random.Random(r * 100 + ARMS.index(arm))
                    # Sessions come in a random order, a few ms apart, as users do (a fixed order
                    # would give placement by load the same worker per session every round).
                    order = list(range(args.sessions))
                    rng_turn.shuffle(order)
                    threads = [threading.Thread(target=session, args=(s,)) for s in order]
                    for t in threads:
                        t.start()
                        time.sleep(rng_turn.uniform(0.0, 0.05))
                    for t in threads:
                        t.join()
                    after = tier_pages(stack)
                    for tier in loaded[arm]:
                        loaded[arm][tier] += after[tier] - before[tier] if r else 0.0
                    for s, row in sorted(results.items()):
                        row.pop("tokens")
                        row.update(arm=arm, round=r, session=s,
                                   same_worker=last_worker.get((arm, s)) == row["worker"])
                        last_worker[(arm, s)] = row["worker"]
                        rows.append(row)
            page_bytes = next(w["stats"].get("kv_page_bytes", 0) for w in _workers(stack))
        finally:
            clients["load"].close()
            stop_process(load_gateway, stack.log_dir / "gateway-load.log")
    first = [row["ttft_ms"] for row in rows if row["round"] == 0]  # every history computed: the miss
    return {"summary": {arm: summarize([row for row in rows if row["arm"] == arm and row["round"] > 0],
                                       loaded[arm], page_bytes) for arm in ARMS},
            "first_round_ttft_ms_p50": statistics.median(first), "requests": rows}


def _workers(stack) -> list[dict]:
    from splitserve.state.store import RedisState
    return RedisState(stack.redis.client()).workers()


def summarize(rows: list[dict], loaded: dict[str, float], page_bytes: int) -> dict:
    """Over the rounds after the first (the first finds its history nowhere)."""
    ttft = [row["ttft_ms"] for row in rows]
    prompt = sum(row["prompt_tokens"] for row in rows)
    return {"requests": len(rows), "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p99": percentile(ttft, 0.99),
            "cached_share": sum(row["cached_tokens"] for row in rows) / prompt,
            "same_worker_share": sum(row["same_worker"] for row in rows) / len(rows),
            "tier_pages_loaded": loaded, "tier_bytes_loaded": {t: n * page_bytes for t, n in loaded.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sessions", type=int, default=4, help="per arm")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--system", type=int, default=200)
    parser.add_argument("--history", type=int, default=1800)
    parser.add_argument("--turn", type=int, default=24)
    parser.add_argument("--reply", type=int, default=16)
    parser.add_argument("--pool-tokens", type=int, default=2560, help="per worker")
    parser.add_argument("--offload-gb", type=float, default=1.0, help="the host tier per worker, when on")
    parser.add_argument("--tiers", default="on,off", help="which stacks to run: on, off or both")
    parser.add_argument("--out", default="bench/results/prefix_routing.json")
    args = parser.parse_args()
    import tempfile
    work = Path(tempfile.mkdtemp(prefix="ss-prefix-routing-"))
    result = {"args": vars(args), "stacks": {}}
    for tiers in args.tiers.split(","):
        result["stacks"][f"tiers_{tiers}"] = run_stack(args, tiers == "on", work)
        print(f"tiers {tiers}:", json.dumps(result["stacks"][f"tiers_{tiers}"]["summary"], indent=1))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
