"""What quantized weights cost and buy, on the real model, against its own float weights.

Systems (``--systems``, each against ``base``, the float checkpoint in the model's dtype):

* ``int8``, ``fp8``: quantized at load from the float checkpoint (``--quantization``);
* ``gguf``: the built-in model's shipped GGUF (Q4_1 linears, Q8_0 embedding) served in its codes;
* ``gptq``, ``awq``, ``w4a16`` (compressed-tensors pack-quantized), ``fp8-checkpoint``
  (compressed-tensors FP8, per channel): checkpoints written from the float weights with each
  format's layout (``tests/harness/quantized_checkpoints.py``; 4-bit round-to-nearest, groups of
  ``--group-size``), then served as shipped.

For each: the bytes of the model's weights as served, and the RSS of a process that loads the engine
and serves one request, its peak and after (a child of its own per system, so none sees another's
memory; eager, so no compiler in it); perplexity of a fixed text through the paged engine
(``bench.kv_quant.perplexity``) and greedy agreement with ``base`` over ``--prompts`` prompts; decode
tok/s at batch 1 and ``--batch`` (prompts of 32 tokens, ``--decode-tokens`` generated, EOS ignored)
and prefill tok/s of one ``--prefill-tokens``-token prompt, all systems interleaved round by round
(the order reversed every other round), medians over ``--rounds``.

    nice -n 10 python -m bench.quantization --systems base,gguf,gptq,awq,w4a16,fp8-checkpoint,int8 \
        --dtypes float32 --out bench/results/quantization_formats.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.common import LoadSampler, decode_rate, median, prefill_rate, write_json
from bench.kv_quant import agreement, fixed_text, greedy, perplexity


# Prompt ids for the rates: ordinary tokens of the model's vocabulary.
VOCAB_IDS = (100, 20000)


def make_llm(model: str, dtype: str, quantization: str | None, **kw):
    from splitserve.engine import LLM
    return LLM(model, dtype=dtype, quantization=quantization, enable_prefix_caching=False, num_gpu_blocks=512,
               block_size=16, max_num_seqs=64, max_num_batched_tokens=1024, **kw)


def rss_mib(model: str, dtype: str, quantization: str | None) -> dict:
    """RSS of a fresh process that builds the engine and runs one request: its peak (with a float
    checkpoint quantized at load, the float weights are loaded first) and what it holds after."""
    # The peak is the process's VmHWM: getrusage's ru_maxrss survives exec, so a child started by
    # a large parent reports the parent's peak (the figures of this benchmark's first runs did).
    code = ("import json, re, psutil; from bench.quantization import make_llm; "
            "from splitserve.engine import SamplingParams; "
            f"llm = make_llm({model!r}, {dtype!r}, {quantization!r}, enforce_eager=True); "
            "llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2)); "
            "hwm = int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)); "
            "print(json.dumps({'peak': hwm / 1024, 'serving': psutil.Process().memory_info().rss / 2**20}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer the model serves with (a tied table counted once)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        try:
            key = t.data_ptr()
        except RuntimeError:  # a oneDNN-packed weight (no plain storage): its logical size
            key = id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def systems(names: list[str], model_dir: Path, work: Path, group: int) -> dict[str, tuple[str, str | None]]:
    """name -> (model directory, --quantization) for each system, writing the checkpoints it needs."""
    from tests.harness.quantized_checkpoints import write_compressed, write_packed
    made: dict[str, tuple[str, str | None]] = {}
    for name in names:
        if name in ("base", "int8", "fp8", "gguf"):
            made[name] = (str(model_dir), None if name == "base" else name)
        elif name in ("gptq", "awq"):
            made[name] = (str(write_packed(model_dir, work / name, name, bits=4, group=group)[0]), None)
        elif name == "w4a16":
            made[name] = (str(write_compressed(model_dir, work / name, "W4A16", "pack-quantized",
                                               group_size=group)[0]), None)
        elif name == "fp8-checkpoint":
            made[name] = (str(write_compressed(model_dir, work / name, "FP8_DYNAMIC", "float-quantized")[0]), None)
        else:
            raise SystemExit(f"unknown system {name!r}")
    return made


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/quantization_formats.json")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtypes", default="float32")
    p.add_argument("--systems", default="base,gguf,gptq,awq,w4a16,fp8-checkpoint,int8")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    names = args.systems.split(",")
    if names[0] != "base":
        raise SystemExit("--systems starts with base (the others are compared with it)")

    from splitserve.engine.model_loader import resolve_model
    text = fixed_text()
    load = LoadSampler().start()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-quantization-") as work:
        made = systems(names, resolve_model(args.model), Path(work), args.group_size)
        for dtype in args.dtypes.split(","):
            entry: dict = {}
            outputs = {}
            for name, (model, quantization) in made.items():  # quality: eager engines
                llm = make_llm(model, dtype, quantization, enforce_eager=True)
                all_ids = llm.get_tokenizer().encode(text)
                ids = all_ids[:args.ppl_tokens + 1]
                stride = (len(all_ids) - 128) // args.prompts
                prompts = [all_ids[i * stride:i * stride + 32 + (i * 37) % 64] for i in range(args.prompts)]
                outputs[name] = greedy(llm, prompts, args.gen_tokens)
                entry[name] = {"perplexity": perplexity(llm, ids, args.chunk),
                               "weight_bytes": weight_bytes(llm.engine.runner.model),
                               "rss_mib": rss_mib(model, dtype, quantization)}
                if name != "base":
                    entry[name]["greedy_agreement"] = agreement(outputs["base"], outputs[name])
                print(dtype, name, json.dumps(entry[name]), flush=True)
                del llm
            llms = {name: make_llm(model, dtype, q) for name, (model, q) in made.items()}  # speed: compiled
            for llm in llms.values():
                decode_rate(llm, 2, 4, 0, VOCAB_IDS)  # warm-up
                prefill_rate(llm, args.prefill_tokens, 0, VOCAB_IDS)
            workloads = {
                "decode_batch1_tok_s": lambda llm, r: decode_rate(llm, 1, args.decode_tokens, r, VOCAB_IDS),
                f"decode_batch{args.batch}_tok_s": lambda llm, r: decode_rate(llm, args.batch, args.decode_tokens, r,
                                                                              VOCAB_IDS),
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
            base = entry["base"]
            entry["ratios"] = {name: {
                "perplexity_delta_pct": 100 * (entry[name]["perplexity"] / base["perplexity"] - 1),
                "weight_bytes": entry[name]["weight_bytes"] / base["weight_bytes"],
                "peak_rss": entry[name]["rss_mib"]["peak"] / base["rss_mib"]["peak"],
                "serving_rss": entry[name]["rss_mib"]["serving"] / base["rss_mib"]["serving"],
                **{w: median(samples[name][w]) / median(samples["base"][w]) for w in workloads}}
                for name in llms if name != "base"}
            results[dtype] = entry
            print(dtype, json.dumps(entry["ratios"], indent=1), flush=True)
            del llms
    load.stop()
    write_json(args.out, {
        "benchmark": "quantization", "load": load.summary(), "config": vars(args),
        "method": ("perplexity: the text prefilled in chunks through the paged engine; agreement: greedy vs the "
                   "float engine; rates: tok/s, all systems interleaved by round, medians; RSS: a child process "
                   "per system; weight bytes: every parameter and buffer the model serves with"),
        "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
