"""Resent histories with and without the host KV tier (``--kv-offloading-size``).

Multi-turn chats resend their growing history. ``--sessions`` sessions each start from a history
of ``--history`` random tokens behind a shared system prompt of ``--system`` tokens; every round,
each session in turn sends its history plus ``--turn`` new tokens and gets ``--reply`` greedy
tokens, which (with the turn) join its history. The device pool (``--pool-tokens``) holds about
one history, so by the time a session comes back its pages were evicted: without the tier its
history is computed again, with it the evicted pages come back from host memory.

One process holds two engines of the model, tier off and on, and each round runs every session
on both, alternating which goes first. A third engine, whose pool holds every history, checks the
tier: its prompts are served from its pool exactly as far as the tier-on engine's are from pool and
tier, so their greedy replies must be the same tokens (the tier's pages are the computed ones, bit
for bit). Without the tier most of each history is computed again, in other chunks, which may
round differently: its replies are reported, not required, to agree. Per request: TTFT (the wall time of a ``max_tokens=1``
call with the same prompt, run right before the full one: a first token offline), how much of
the prompt was cached, and the pages the tier stored and loaded. Reported: TTFT p50/p99 per
engine over the rounds after the first (the first finds nothing anywhere), the share of prompt
tokens served from cache, and the bytes the tier moved.

    python -m bench.kv_offload --out bench/results/kv_offload.json
    python -m bench.kv_offload --offload-gb 0.05 --offload-disk-gb 1 --out bench/results/kv_offload_disk.json
    python -m bench.kv_offload --shared --out bench/results/kv_offload_shared.json
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

from bench.common import LoadSampler, percentile, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--system", type=int, default=200)
    parser.add_argument("--history", type=int, default=1800)
    parser.add_argument("--turn", type=int, default=24)
    parser.add_argument("--reply", type=int, default=16)
    parser.add_argument("--pool-tokens", type=int, default=2560)
    parser.add_argument("--offload-gb", type=float, default=1.0, help="the host tier (--kv-offloading-size)")
    parser.add_argument("--offload-disk-gb", type=float, default=0.0,
                        help="a disk tier below it (--kv-offloading-disk-size; files in the temporary directory)")
    parser.add_argument("--shared", action="store_true",
                        help="a fourth engine whose host tier is the shared one (--kv-offloading-shared), timed too")
    parser.add_argument("--out", default="bench/results/kv_offload.json")
    args = parser.parse_args()

    from splitserve.engine import LLM, SamplingParams

    rng = random.Random(0)
    system = [rng.randrange(1000, 40000) for _ in range(args.system)]
    histories = [system + [rng.randrange(1000, 40000) for _ in range(args.history)] for _ in range(args.sessions)]
    block = 16
    common = dict(dtype=args.dtype, block_size=block, num_gpu_blocks=args.pool_tokens // block,
                  max_model_len=args.system + args.history + args.rounds * (args.turn + args.reply) + 64)
    engines = {"tier off": LLM(args.model, **common),
               "tier on": LLM(args.model, **common, kv_offloading_size=args.offload_gb,
                              kv_offloading_disk_size=args.offload_disk_gb),
               "pool holds all": LLM(args.model, **{**common, "num_gpu_blocks": common["max_model_len"]
                                                    * args.sessions // block + 1})}
    if args.shared:
        engines["shared tier"] = LLM(args.model, **common, kv_offloading_size=args.offload_gb, kv_offloading_shared=True)
    page_bytes = engines["tier on"].engine.runner.host_kv.page_bytes
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    reply = SamplingParams(temperature=0, max_tokens=args.reply, ignore_eos=True)
    # Each engine's own copy of every history: both see the same prompts (greedy replies agree).
    sessions = {name: [list(h) for h in histories] for name in engines}
    records: dict[str, list[dict]] = {name: [] for name in engines}
    load = LoadSampler().start()
    for round_no in range(args.rounds):
        turns = [[rng.randrange(1000, 40000) for _ in range(args.turn)] for _ in range(args.sessions)]
        timed = ["tier off", "tier on"] + (["shared tier"] if args.shared else [])
        order = (timed if round_no % 2 == 0 else timed[::-1]) + ["pool holds all"]
        for s in range(args.sessions):
            for name in order:
                llm = engines[name]
                prompt = sessions[name][s] + turns[s]
                tier = llm.engine.kv.offload
                loaded = tier.stats.loaded + tier.stats.disk_loaded if tier else 0
                start = time.perf_counter()
                head = llm.generate([prompt], first)[0]
                ttft = time.perf_counter() - start
                out = llm.generate([prompt], reply)[0]
                sessions[name][s] = prompt + out.token_ids
                records[name].append({"round": round_no, "session": s, "prompt_tokens": len(prompt),
                                      "ttft_s": ttft, "cached_tokens": head.num_cached_tokens,
                                      "pages_loaded": (tier.stats.loaded + tier.stats.disk_loaded - loaded)
                                      if tier else 0})
                print(f"round {round_no} session {s} {name}: TTFT {ttft * 1e3:.0f} ms, "
                      f"{head.num_cached_tokens}/{len(prompt)} cached", flush=True)
    load.stop()
    assert sessions["tier on"] == sessions["pool holds all"], "the tier served other KV than the pool would have"
    if args.shared:
        assert sessions["shared tier"] == sessions["pool holds all"], "the shared tier served other KV"
    results = {"tier off replies agree": sessions["tier off"] == sessions["tier on"]}
    for name, rows in records.items():
        later = [r for r in rows if r["round"] > 0]
        ttfts = [r["ttft_s"] for r in later]
        results[name] = {"ttft_p50_ms": statistics.median(ttfts) * 1e3, "ttft_p99_ms": percentile(ttfts, 0.99) * 1e3,
                         "cached_share": sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later),
                         "pages_loaded": sum(r["pages_loaded"] for r in later)}
    tier = engines["tier on"].engine.kv.offload
    results["tier on"].update(dataclasses.asdict(tier.stats), bytes_stored=tier.stats.stored * page_bytes,
                              bytes_loaded=(tier.stats.loaded + tier.stats.disk_loaded) * page_bytes,
                              bytes_to_disk=tier.stats.disk_stored * page_bytes,
                              bytes_from_disk=tier.stats.disk_loaded * page_bytes)
    results["ttft_p50_on_vs_off"] = results["tier on"]["ttft_p50_ms"] / results["tier off"]["ttft_p50_ms"]
    for name in timed:
        r = results[name]
        print(f"{name:9s} TTFT p50 {r['ttft_p50_ms']:.0f} ms p99 {r['ttft_p99_ms']:.0f} ms, "
              f"cached {r['cached_share']:.2f} of prompt tokens")
    print(f"TTFT p50 with the tier: {results['ttft_p50_on_vs_off']:.2f}x of without")
    write_json(args.out, {"benchmark": "kv_offload", "args": vars(args), "page_bytes": page_bytes,
                          "results": results, "requests": records, "load_average": load.summary()})


if __name__ == "__main__":
    main()
