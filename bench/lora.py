"""Throughput of a batch spread over LoRA adapters, against the base model alone.

One process holds two engines of the same model: the base one (no LoRA) and one started with
``enable_lora`` (``--max-loras`` slots of ``--max-lora-rank``) serving ``--adapters`` random PEFT
adapters (every projection, rank ``--rank``). Each case generates ``--batch`` prompts of
``--prompt-len`` random tokens, ``--max-tokens`` greedy tokens each (ignore_eos), in one call;
its tok/s is output tokens over the call's wall time. The cases -- the base engine, the LoRA
engine with base requests only, and the batch spread evenly over 1, 4 and 16 adapters -- are
alternated for ``--rounds`` rounds and reported as medians and as a ratio to the base engine.

    python -m bench.lora --out bench/results/lora.json
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from bench.common import LoadSampler, median, write_json


def make_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    paths = []
    for i in range(count):
        torch.manual_seed(i)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.02)
        model.save_pretrained(out / f"adapter-{i}")
        paths.append(out / f"adapter-{i}")
        base = model.unload()  # the base model back, without this adapter's layers
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-lora-rank", type=int, default=8)
    parser.add_argument("--spreads", default="1,4,16", help="adapters the batch is spread over, per case")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench/results/lora.json")
    args = parser.parse_args()

    from splitserve.engine import LLM, SamplingParams
    from splitserve.engine.model_loader import resolve_model

    spreads = [int(s) for s in args.spreads.split(",")]
    model_dir = resolve_model(args.model)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(model_dir, Path(tmp), args.adapters, args.rank)
        common = dict(dtype=args.dtype, max_num_seqs=args.batch, enable_prefix_caching=False)
        base = LLM(args.model, **common)
        lora = LLM(args.model, **common, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.max_lora_rank)
        for i, path in enumerate(paths):
            lora.add_lora(f"adapter-{i}", path)

    def run(llm, names) -> float:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, lora=names)
        seconds = time.perf_counter() - start
        return sum(len(o.token_ids) for o in outs) / seconds

    cases = {"base engine": (base, None), "lora engine, base requests": (lora, None)}
    for spread in spreads:
        cases[f"lora engine, {spread} adapters"] = (lora, [f"adapter-{i % spread}" for i in range(args.batch)])
    for llm, names in cases.values():  # warm-up: compiled steps for every shape, adapters in their slots
        run(llm, names)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    load = LoadSampler().start()
    for _ in range(args.rounds):
        for name, (llm, names) in cases.items():
            samples[name].append(run(llm, names))
            print(f"{name}: {samples[name][-1]:.1f} tok/s", flush=True)
    load.stop()
    base_median = median(samples["base engine"])
    results = {name: {"tok_per_s": median(values), "samples": values, "vs_base": median(values) / base_median}
               for name, values in samples.items()}
    for name, r in results.items():
        print(f"{name:32s} {r['tok_per_s']:8.1f} tok/s  {r['vs_base']:.2f}x")
    write_json(args.out, {"benchmark": "lora", "args": vars(args), "results": results, "load_average": load.summary()})


if __name__ == "__main__":
    main()
