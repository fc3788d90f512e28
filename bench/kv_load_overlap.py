"""Tier hits brought back beside the step (``kv_offloading_overlap``, the default) or inside it.

A request is decoding (``--decode-tokens`` greedy tokens of a short prompt) when a resent history
of ``--history`` tokens arrives whose pages were pushed out of the pool (two other histories came
after it) into the KV tiers: with ``--disk-gb`` a host tier too small to keep them (``--host-gb``)
over a disk tier, so the history comes back from disk files; with ``--disk-gb 0`` from host memory.
Inside the step, the decoding request waits for every copy (its longest gap between two tokens
grows by the load); beside it, the loader thread copies while the decoding goes on, and the
history waits for its pages instead. Per round: the decoding request's longest gap and median gap
while the history is loaded and prefilled, and the history's TTFT. Two engines in one process,
overlap on and off, alternated round by round, on the same prompts.

    python -m bench.kv_load_overlap --out bench/results/kv_load_overlap_disk.json
    python -m bench.kv_load_overlap --disk-gb 0 --host-gb 1 --out bench/results/kv_load_overlap_host.json
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.common import LoadSampler, write_json

ARMS = ("overlap", "inline")


def round_of(engine, rng: random.Random, args) -> dict:
    from splitserve.engine import SamplingParams
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    history, *others = [[rng.randrange(1000, 40000) for _ in range(args.history)] for _ in range(3)]
    for i, prompt in enumerate([history, *others]):  # the history computed, then pushed out of the pool
        engine.add_request(f"fill-{i}", prompt, one)
        while engine.has_unfinished_requests():
            engine.step()
    decode_prompt = [rng.randrange(1000, 40000) for _ in range(32)]
    engine.add_request("decoding", decode_prompt,
                       SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True))
    stamps: list[float] = []
    sent = ttft = None
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "decoding" and len(out.token_ids) > len(stamps):
                stamps.append(time.perf_counter())
            if out.request_id == "history" and ttft is None and out.token_ids:
                ttft, cached = time.perf_counter() - sent, out.num_cached_tokens
        if sent is None and len(stamps) == args.decode_tokens // 4:
            engine.add_request("history", history + [7, 8, 9], one)
            sent = time.perf_counter()
    # The gaps from the history's arrival to its first token, and one step after.
    window = [b - a for a, b in zip(stamps, stamps[1:]) if b >= sent and a <= sent + ttft]
    return {"ttft_ms": 1e3 * ttft, "cached_tokens": cached, "max_gap_ms": 1e3 * max(window),
            "median_gap_ms": 1e3 * statistics.median(window), "gaps": len(window)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--history", type=int, default=2000)
    parser.add_argument("--decode-tokens", type=int, default=120)
    parser.add_argument("--pool-tokens", type=int, default=4096)
    parser.add_argument("--host-gb", type=float, default=0.002)
    parser.add_argument("--disk-gb", type=float, default=2.0)
    parser.add_argument("--out", default="bench/results/kv_load_overlap.json")
    args = parser.parse_args()

    from splitserve.engine import LLM
    common = dict(dtype=args.dtype, block_size=16, num_gpu_blocks=args.pool_tokens // 16, max_model_len=4096,
                  kv_offloading_size=args.host_gb, kv_offloading_disk_size=args.disk_gb)
    engines = {"overlap": LLM(args.model, **common).engine,
               "inline": LLM(args.model, **common, kv_offloading_overlap=False).engine}
    rows: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    load = LoadSampler().start()
    for r in range(args.rounds):
        for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
            row = round_of(engines[arm], random.Random(r), args)  # the same prompts for both
            rows[arm].append(row)
            print(f"round {r} {arm}: TTFT {row['ttft_ms']:.0f} ms ({row['cached_tokens']} cached), decoding's "
                  f"longest gap {row['max_gap_ms']:.0f} ms, median {row['median_gap_ms']:.0f} ms", flush=True)
    load.stop()
    summary = {arm: {key: statistics.median(row[key] for row in arm_rows)
                     for key in ("ttft_ms", "max_gap_ms", "median_gap_ms", "cached_tokens")}
               for arm, arm_rows in rows.items()}
    summary["max_gap_overlap_vs_inline"] = summary["overlap"]["max_gap_ms"] / summary["inline"]["max_gap_ms"]
    summary["ttft_overlap_vs_inline"] = summary["overlap"]["ttft_ms"] / summary["inline"]["ttft_ms"]
    print(summary)
    write_json(args.out, {"benchmark": "kv_load_overlap", "args": vars(args), "summary": summary, "rounds": rows,
                          "load_average": load.summary()})


if __name__ == "__main__":
    main()
