"""Continuous batching vs static batching (same engine) vs transformers static `generate`.

Workload: `mixed` from shared/BENCHMARKS.md, all requests at t=0, ignore_eos. The three
systems run interleaved (A B C, A B C, ...) after one warm-up round; medians are reported.
Throughput = useful output tokens / wall time. For the continuous engine the step time is
split into scheduler (schedule + update), forward+sampling (runner.run) so the CPU overhead
per step is visible.

    python -m bench.engine_throughput --out bench/results/engine_throughput.json
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

from bench.common import median, write_json
from bench.workloads import mixed
from engine import LLM, SamplingParams


def run_engine(llm: LLM, requests) -> dict:
    """Drive the engine step by step, timing its phases."""
    engine = llm.engine
    for r in requests:
        engine.add_request(None, r.prompt_token_ids,
                           SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True))
    sched_s = run_s = 0.0
    steps = row_tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        plan = engine.scheduler.schedule()
        t1 = time.perf_counter()
        sampled = engine.runner.run(plan)
        t2 = time.perf_counter()
        for request in engine.scheduler.update(plan, sampled):
            if request.is_finished:
                engine.requests.pop(request.request_id, None)
        t3 = time.perf_counter()
        sched_s += (t1 - t0) + (t3 - t2)
        run_s += t2 - t1
        steps += 1
        row_tokens += plan.num_batched_tokens
    engine.scheduler.schedule()  # a static engine releases its last batch here
    wall = time.perf_counter() - start
    engine.assert_idle()
    return {"wall_s": wall, "steps": steps, "scheduler_s": sched_s, "runner_s": run_s,
            "row_tokens_computed": row_tokens}


def run_hf(model, tokenizer_pad_id: int, requests, batch_size: int, eos_never: int) -> dict:
    """transformers `generate` in static batches of `batch_size`, left-padded, each batch to its longest."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = eos_never  # ignore_eos without masking EOS
    config.pad_token_id = tokenizer_pad_id
    start = time.perf_counter()
    row_tokens = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), tokenizer_pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        new = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, generation_config=config, max_new_tokens=new, do_sample=False)
        row_tokens += len(batch) * (width + new)
    return {"wall_s": time.perf_counter() - start, "row_tokens_computed": row_tokens}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8, help="static batch size (engine static and HF)")
    parser.add_argument("--pairs", type=int, default=3, help="measured rounds after the warm-up")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    # Prefix caching off: every round replays the same prompts, and hits would flatter the engine.
    common = dict(dtype=args.dtype, block_size=16, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048,
                  kv_cache_memory_gb=1.0, enable_prefix_caching=False)
    continuous = LLM(args.model, batching="continuous", **common)
    static = LLM(args.model, batching="static", static_batch_size=args.batch_size, **common)
    from engine.model_loader import load_model, resolve_model
    hf_model = load_model(resolve_model(args.model), continuous.engine.runner.dtype, "cpu", attn_implementation="sdpa")
    tokenizer = continuous.get_tokenizer()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    vocab = continuous.engine.vocab_size
    requests = mixed(args.num_requests, vocab, seed=args.seed)
    useful = sum(r.max_tokens for r in requests)

    systems = {
        "continuous": lambda: run_engine(continuous, requests),
        "static": lambda: run_engine(static, requests),
    }
    if not args.skip_hf:
        systems["hf_static"] = lambda: run_hf(hf_model, pad_id, requests, args.batch_size, eos_never=vocab)
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    for round_ in range(args.pairs + 1):
        for name, fn in systems.items():
            result = fn()
            tag = "warm-up" if round_ == 0 else f"round {round_}"
            print(f"{tag:8s} {name:11s} {result['wall_s']:7.2f} s  {useful / result['wall_s']:7.1f} tok/s", flush=True)
            if round_:
                runs[name].append(result)

    summary = {}
    for name, results in runs.items():
        wall = median([r["wall_s"] for r in results])
        summary[name] = {"median_wall_s": wall, "output_tokens_per_s": useful / wall,
                         "requests_per_s": len(requests) / wall,
                         "row_tokens_computed": results[0]["row_tokens_computed"]}
        if "steps" in results[0]:
            steps = results[0]["steps"]
            summary[name].update(
                steps=steps,
                scheduler_ms_per_step=1000 * median([r["scheduler_s"] / r["steps"] for r in results]),
                runner_ms_per_step=1000 * median([r["runner_s"] / r["steps"] for r in results]))
    ratios = {"continuous_over_static": summary["static"]["median_wall_s"] / summary["continuous"]["median_wall_s"]}
    if "hf_static" in summary:
        ratios["continuous_over_hf_static"] = summary["hf_static"]["median_wall_s"] / summary["continuous"]["median_wall_s"]
        ratios["static_over_hf_static"] = summary["hf_static"]["median_wall_s"] / summary["static"]["median_wall_s"]
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    write_json(args.out, {
        "benchmark": "engine_throughput",
        "workload": {"name": "mixed", "num_requests": len(requests), "useful_output_tokens": useful,
                     "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests), "seed": args.seed},
        "config": {**common, "model": args.model, "static_batch_size": args.batch_size, "pairs": args.pairs},
        "method": "interleaved rounds after one warm-up; medians; throughput = useful output tokens / wall time",
        "systems": summary, "ratios": ratios, "runs": runs,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
