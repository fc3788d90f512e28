"""What quantized weights (``--quantization``) cost and buy, on the real model, against its own dtype.

For each model dtype (``--dtypes``), the unquantized engine (A) and the int8 one (B):

* weight bytes of the linear layers (``QuantizedWeights``), and the RSS of a process that loads the
  engine and serves one request, its peak and after (a child of its own per system, so neither
  sees the other's memory; eager, so no compiler in it);
* perplexity of a fixed text through the paged engine (``bench.kv_quant.perplexity``: the same
  method as the KV-quantization benchmark), and greedy agreement with A over ``--prompts`` prompts;
* decode tok/s at batch 1 and ``--batch`` (prompts of 32 tokens, ``--decode-tokens`` generated,
  EOS ignored), and prefill tok/s of one ``--prefill-tokens``-token prompt; A and B interleaved
  round by round (A B, B A, ...), medians over ``--rounds``.

    nice -n 10 python -m bench.quantization --out bench/results/quantization.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from bench.common import LoadSampler, decode_rate, median, prefill_rate, write_json
from bench.kv_quant import agreement, fixed_text, greedy, perplexity


# Prompt ids for the rates: ordinary tokens of the model's vocabulary.
VOCAB_IDS = (100, 20000)


def make_llm(model: str, dtype: str, quantization: str | None, **kw):
    from splitserve.engine import LLM
    return LLM(model, dtype=dtype, quantization=quantization, enable_prefix_caching=False, num_gpu_blocks=2048,
               block_size=16, max_num_seqs=64, max_num_batched_tokens=1024, **kw)


def rss_mib(model: str, dtype: str, quantization: str | None) -> dict:
    """RSS of a fresh process that builds the engine and runs one request: its peak (the float
    checkpoint is loaded before it is quantized) and what it holds after (what it serves with)."""
    code = ("import json, resource, psutil; from bench.quantization import make_llm; "
            "from splitserve.engine import SamplingParams; "
            f"llm = make_llm({model!r}, {dtype!r}, {quantization!r}, enforce_eager=True); "
            "llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2)); "
            "print(json.dumps({'peak': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "
            "'serving': psutil.Process().memory_info().rss / 2**20}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/quantization.json")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--method", default="int8")
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    text = fixed_text()
    load = LoadSampler().start()
    results = {}
    for dtype in args.dtypes.split(","):
        systems = {"base": None, args.method: args.method}
        entry: dict = {}
        outputs = {}
        for name, quantization in systems.items():  # quality: eager engines (perplexity runs its own steps)
            llm = make_llm(args.model, dtype, quantization, enforce_eager=True)
            all_ids = llm.get_tokenizer().encode(text)
            ids = all_ids[:args.ppl_tokens + 1]
            stride = (len(all_ids) - 128) // args.prompts
            prompts = [all_ids[i * stride:i * stride + 32 + (i * 37) % 64] for i in range(args.prompts)]
            quantized = llm.engine.runner.quantized_weights
            outputs[name] = greedy(llm, prompts, args.gen_tokens)
            entry[name] = {"perplexity": perplexity(llm, ids, args.chunk),
                           "linear_weight_bytes": None if quantized is None else quantized.bytes_after,
                           "rss_mib": rss_mib(args.model, dtype, quantization)}
            if quantized is not None:
                entry["base"]["linear_weight_bytes"] = quantized.bytes_before
                entry[name]["greedy_agreement"] = agreement(outputs["base"], outputs[name])
            del llm
        llms = {name: make_llm(args.model, dtype, q) for name, q in systems.items()}  # speed: compiled steps
        for llm in llms.values():
            decode_rate(llm, 2, 4, 0, VOCAB_IDS)  # warm-up
            prefill_rate(llm, args.prefill_tokens, 0, VOCAB_IDS)
        workloads = {"decode_batch1_tok_s": lambda llm, r: decode_rate(llm, 1, args.decode_tokens, r, VOCAB_IDS),
                     f"decode_batch{args.batch}_tok_s": lambda llm, r: decode_rate(llm, args.batch,
                                                                                   args.decode_tokens, r, VOCAB_IDS),
                     f"prefill_{args.prefill_tokens}_tok_s": lambda llm, r: prefill_rate(llm, args.prefill_tokens, r,
                                                                                     VOCAB_IDS)}
        samples = {name: {w: [] for w in workloads} for name in llms}
        for r in range(args.rounds):
            order = list(llms) if r % 2 == 0 else list(reversed(llms))
            for w, run in workloads.items():
                for name in order:
                    samples[name][w].append(run(llms[name], r + 1))
        for name in llms:
            entry[name].update({w: median(v) for w, v in samples[name].items()}, samples=samples[name])
        base_ppl = entry["base"]["perplexity"]
        entry["ratios"] = {
            "perplexity_delta_pct": 100 * (entry[args.method]["perplexity"] / base_ppl - 1),
            "linear_weight_bytes": entry[args.method]["linear_weight_bytes"] / entry["base"]["linear_weight_bytes"],
            "peak_rss": entry[args.method]["rss_mib"]["peak"] / entry["base"]["rss_mib"]["peak"],
            "serving_rss": entry[args.method]["rss_mib"]["serving"] / entry["base"]["rss_mib"]["serving"],
            **{w: median(samples[args.method][w]) / median(samples["base"][w]) for w in workloads}}
        results[dtype] = entry
        print(dtype, json.dumps(entry["ratios"]), flush=True)
        del llms
    load.stop()
    write_json(args.out, {
        "benchmark": "quantization", "load": load.summary(), "config": vars(args),
        "method": ("perplexity: the text prefilled in chunks through the paged engine; agreement: greedy vs the "
                   "unquantized engine; rates: tok/s, the two engines interleaved by round, medians; RSS: a child "
                   "process per system"),
        "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
