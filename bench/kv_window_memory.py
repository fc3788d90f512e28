"""KV memory of windowed layers: what a GiB of KV holds for Gemma-3-shaped models when the
windowed layers' pages go back behind the window (the engine's KV groups, ``kv_groups``) and
when every page is kept (``--disable-hybrid-kv-cache-manager``).

Two measurements, both with the engine's own code:

1. Capacity, per shape and sequence length L. The pool is what the runner makes of ``--gib`` GiB
   (pages of one group's layers, ``kv_bytes_per_token``). A ``KVCacheManager`` over it takes
   sequences of L tokens, each computed ``--step-tokens`` at a time and slid before each step as
   the scheduler slides it (and once more at L, as before its next decode), until the next one
   does not fit: tokens held per GiB, and pages per GiB.
2. The engine itself, at Gemma-3-1B's shape with random weights (``--load-format dummy``): the
   pool 1 GiB buys both ways, and the pages one request of ``--prompt`` tokens holds (per group)
   after it has generated ``--generate`` tokens.

    python -m bench.kv_window_memory --out bench/results/kv_window_memory.json
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.common import write_json

# The published config.json of each model's text stack (Gemma 3: every sixth layer full).
SHAPES = {
    "gemma-3-1b": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                       num_key_value_heads=1, head_dim=256, sliding_window=512, query_pre_attn_scalar=256),
    "gemma-3-4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=256, sliding_window=1024, query_pre_attn_scalar=256),
    "gemma-3-27b": dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
                        num_key_value_heads=16, head_dim=128, sliding_window=1024, query_pre_attn_scalar=168),
}
BF16_BYTES = 2


def gemma3_config(shape: str):
    import transformers
    config = transformers.Gemma3TextConfig(vocab_size=262144, max_position_embeddings=32768, **SHAPES[shape])
    config.architectures = ["Gemma3ForCausalLM"]
    return config


def capacity(shape: str, length: int, block_size: int, step_tokens: int, hybrid: bool, gib: float) -> dict:
    from splitserve.engine.kv_cache_manager import KVCacheManager
    from splitserve.engine.kv_groups import layer_windows, one_group, plan_groups
    from splitserve.engine.kv_sizes import kv_bytes_per_token, pages_for_budget

    config = gemma3_config(shape)
    groups = plan_groups(layer_windows(config)) if hybrid else one_group(config.num_hidden_layers)
    per_token = kv_bytes_per_token(groups.slots, config.num_key_value_heads, config.head_dim, BF16_BYTES)
    pages = pages_for_budget(gib, per_token, block_size)
    kv = KVCacheManager(pages, block_size, enable_prefix_caching=False, windows=groups.windows,
                        max_step_tokens=step_tokens)
    sequences = 0
    while True:
        rid, done = f"s{sequences}", 0
        while done < length:
            if kv.owns(rid):
                kv.slide(rid, done)
            if kv.allocate(rid, min(length, done + step_tokens)) is None:
                break
            done = min(length, done + step_tokens)
        if done < length:
            kv.free(rid)
            break
        kv.slide(rid, length)  # as before its next step: it decodes on from here
        sequences += 1
    kv.check_invariants()
    return {"groups": len(groups.windows), "layers_per_page": groups.slots, "padded_slots": groups.padded_slots,
            "page_bytes": per_token * block_size, "pages_per_gib": round(pages / gib),
            "sequences": sequences, "tokens_per_gib": round(sequences * length / gib)}


def engine_run(args) -> dict:
    """Gemma-3-1B's shape through the engine, both ways: pool pages for 1 GiB and one request's pages."""
    from splitserve.engine import LLM, SamplingParams
    from tests.harness.tiny_models import byte_tokenizer

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        (path / "config.json").write_text(gemma3_config("gemma-3-1b").to_json_string())
        byte_tokenizer().save_pretrained(path)
        for name, hybrid in (("kept", False), ("grouped", True)):
            llm = LLM(model=str(path), load_format="dummy", dtype="bfloat16", enforce_eager=True,
                      block_size=args.block_size, kv_cache_memory_gb=1.0, enable_prefix_caching=False,
                      max_num_batched_tokens=args.step_tokens, disable_hybrid_kv_cache_manager=not hybrid)
            engine = llm.engine
            held: dict = {}
            original = engine.scheduler.schedule

            def schedule():  # the pages the request holds at its last step, as the scheduler left them
                plan = original()
                for rid in plan.block_tables:
                    tables = engine.kv.block_tables(rid)
                    held["per_group"] = [len(t) - r for t, r in zip(tables, engine.kv._owners[rid].released)]
                return plan
            engine.scheduler.schedule = schedule
            start = time.perf_counter()
            llm.generate([[5 + i % 200 for i in range(args.prompt)]],
                         SamplingParams(temperature=0.0, max_tokens=args.generate, ignore_eos=True))
            out[name] = {"pool_pages_per_gib": engine.kv.num_total_blocks,
                         "layers_per_page": engine.runner.kv_groups.slots,
                         "request_pages_per_group": held["per_group"],
                         "request_pages": sum(held["per_group"]),
                         "request_bytes": sum(held["per_group"]) * engine.runner.kv_bytes_per_token * args.block_size,
                         "seconds": round(time.perf_counter() - start, 1)}
            engine.assert_idle()
    out["request_bytes_kept_over_grouped"] = round(out["kept"]["request_bytes"] / out["grouped"]["request_bytes"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,4096,8192,32768")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--step-tokens", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--gib", type=float, default=64.0, help="KV pool of the capacity count (results per GiB)")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--generate", type=int, default=8)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    for shape in SHAPES:
        for length in (int(x) for x in args.lengths.split(",")):
            kept = capacity(shape, length, args.block_size, args.step_tokens, hybrid=False, gib=args.gib)
            grouped = capacity(shape, length, args.block_size, args.step_tokens, hybrid=True, gib=args.gib)
            rows.append({"shape": shape, "length": length, "kept": kept, "grouped": grouped,
                         "tokens_grouped_over_kept": round(grouped["tokens_per_gib"] / max(1, kept["tokens_per_gib"]), 2)})
            print(f"{shape:12s} L={length:6d}: tokens/GiB kept {kept['tokens_per_gib']:>9,d}, "
                  f"grouped {grouped['tokens_per_gib']:>9,d} ({rows[-1]['tokens_grouped_over_kept']}x); "
                  f"pages/GiB {kept['pages_per_gib']} vs {grouped['pages_per_gib']}", flush=True)
    result = {"block_size": args.block_size, "step_tokens": args.step_tokens, "kv_dtype": "bfloat16", "gib": args.gib,
              "capacity_per_gib": rows}
    if not args.skip_engine:
        result["engine_gemma_3_1b"] = engine_run(args)
        print(result["engine_gemma_3_1b"], flush=True)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
