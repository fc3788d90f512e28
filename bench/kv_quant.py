"""What quantized KV pages (``--kv-cache-dtype``) cost and buy, on the real model.

* Perplexity of a fixed text (the source of Python's ``argparse`` module, the first ``--ppl-tokens``
  tokens; its sha256 is recorded) computed through the paged engine: the text is prefilled in
  chunks of ``--chunk`` tokens into the engine's own pool, so every chunk after the first attends
  to the quantized pages of the earlier ones, exactly as a long prompt or a decode would.
* Greedy agreement with ``auto`` of the first ``--gen-tokens`` tokens over ``--prompts`` prompts
  (slices of the same text): share of prompts that agree on all of them, mean length of the common
  prefix, share of equal positions.
* Pages per GiB of KV memory (the engine's own pool sizing).
* Decode step time, auto vs int8, ``--batch`` sequences of ``--context`` tokens, whole
  ``engine.step()`` calls, the two engines interleaved round by round (A/B, B/A, ...); and the
  CPU decode attention kernel alone (``splitserve_cpu::paged_decode``, SmolLM2's heads) over
  model-dtype vs int8 pages at ``--kernel-contexts``, interleaved the same way.

    nice -n 10 python -m bench.kv_quant --out bench/results/kv_quant.json
    nice -n 10 python -m bench.kv_quant --only-step-time --out bench/results/kv_quant_step_time.json
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import math
import time

import torch

from bench.common import LoadSampler, median, write_json

FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")


def fixed_text() -> str:
    import argparse as source
    return inspect.getsource(source)


def make_llm(model: str, kv: str, **kw):
    from splitserve.engine import LLM
    return LLM(model, kv_cache_dtype=kv, enable_prefix_caching=False, **kw)


@torch.inference_mode()
def perplexity(llm, ids: list[int], chunk: int) -> float:
    """exp(mean NLL of token t+1 given tokens <= t) with the text prefilled chunk by chunk into the pool."""
    from splitserve.engine.attention import StepLayout
    from splitserve.engine.attention.hf_integration import StepContext, step_context
    engine, runner = llm.engine, llm.engine.runner
    n = len(ids)
    if engine.kv.allocate("ppl", n) is None:
        raise RuntimeError("KV pool too small for the text")
    try:
        table = torch.tensor([engine.kv.block_table("ppl")], dtype=torch.int32)
        bs = runner.block_size
        slots_all = (table[0].long()[torch.arange(n) // bs] * bs + torch.arange(n) % bs)
        tokens = torch.tensor(ids)
        nll, count = 0.0, 0
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            layout = StepLayout(slot_mapping=slots_all[start:end],
                                query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
                                seq_lens=torch.tensor([end], dtype=torch.int32), block_tables=table,
                                num_decodes=0, query_lens_list=[end - start], seq_lens_list=[end], block_size=bs)
            ctx = StepContext(runner.backend, layout, runner.backend.prepare(layout), runner.kv_caches)
            with step_context(ctx):
                hidden = runner.forward(tokens[start:end], torch.arange(start, end))
            logits = runner.model.lm_head(hidden).float()
            targets = tokens[start + 1:end + 1]
            logp = torch.log_softmax(logits[:len(targets)], dim=-1)
            nll -= logp.gather(1, targets[:, None]).sum().item()
            count += len(targets)
        return math.exp(nll / count)
    finally:
        engine.kv.free("ppl")


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from splitserve.engine import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def agreement(base: list[list[int]], other: list[list[int]]) -> dict:
    prefix = []
    for a, b in zip(base, other):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefix.append(k)
    positions = [x == y for a, b in zip(base, other) for x, y in zip(a, b)]
    return {"all_tokens_equal": sum(p == len(a) for p, a in zip(prefix, base)) / len(base),
            "mean_common_prefix": sum(prefix) / len(prefix),
            "positions_equal": sum(positions) / len(positions)}


def step_time(llms: dict, batch: int, context: int, steps: int, rounds: int) -> dict:
    """Median decode step per arm; arms alternate every round, in alternating order."""
    from splitserve.engine import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
    for kv, llm in llms.items():
        engine = llm.engine
        vocab = engine.vocab_size
        for i in range(batch):
            rid = f"s{i}"
            if engine.kv.allocate(rid, context) is None:
                raise RuntimeError("KV pool too small for the step-time cell")
            engine.add_prefilled_request(rid, [(i * 131 + j) % vocab for j in range(context)], params, first_token=1)
        for _ in range(3):
            engine.step()
    times: dict[str, list[float]] = {kv: [] for kv in llms}
    names = list(llms)
    for r in range(rounds):
        for kv in (names if r % 2 == 0 else names[::-1]):
            for _ in range(steps):
                t0 = time.perf_counter()
                llms[kv].engine.step()
                times[kv].append(time.perf_counter() - t0)
    for llm in llms.values():
        for i in range(batch):
            llm.engine.abort_request(f"s{i}")
    return {kv: {"median_ms": 1000 * median(t), "steps": len(t)} for kv, t in times.items()}


def kernel_time(dtype: torch.dtype, batch: int, contexts: list[int], rounds: int, reps: int = 20) -> list[dict]:
    """Median time of one paged_decode call (30 of them make a step) over `dtype` vs int8 pages."""
    from splitserve.engine.attention import cpu_kernels
    from splitserve.engine.attention.kv_quant import kv_quant, quantize
    if not cpu_kernels.available():
        return []
    hq, hkv, d, bs = 9, 3, 64, 16  # SmolLM2-135M's attention
    cells = []
    for context in contexts:
        pages = -(-context // bs)
        gen = torch.Generator().manual_seed(context)
        k, v = (torch.randn(batch * pages, bs, hkv, d, generator=gen) for _ in range(2))
        caches = {"auto": (k.to(dtype), v.to(dtype)), "int8": (quantize(k, kv_quant("int8")), quantize(v, kv_quant("int8")))}
        query = torch.randn(batch, hq, d, generator=gen).to(dtype)
        tables = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
        lens = torch.full((batch,), context, dtype=torch.int32)
        out = torch.empty_like(query)
        times: dict[str, list[float]] = {"auto": [], "int8": []}
        for r in range(rounds):
            for kv in (("auto", "int8") if r % 2 == 0 else ("int8", "auto")):
                for _ in range(reps):
                    t0 = time.perf_counter()
                    torch.ops.splitserve_cpu.paged_decode(out, query, *caches[kv], tables, lens, d ** -0.5)
                    times[kv].append(time.perf_counter() - t0)
        a, b = median(times["auto"]), median(times["int8"])
        cells.append({"batch": batch, "context": context, "auto_us": 1e6 * a, "int8_us": 1e6 * b, "int8_vs_auto": b / a})
        print(f"paged_decode kernel batch {batch} x context {context}: {dtype} {1e6 * a:.0f} us, int8 {1e6 * b:.0f} us "
              f"({b / a:.2f}x)", flush=True)
    return cells


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/kv_quant.json")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto", help="model dtype (auto: bf16 where the CPU computes it, else fp32)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--skip-step-time", action="store_true")
    p.add_argument("--only-step-time", action="store_true", help="the step and kernel timings, no quality figures")
    p.add_argument("--kernel-contexts", default="512,2048,8192")
    args = p.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]

    text = fixed_text()
    load = LoadSampler().start()  # the cores are shared: record how busy they were
    common = dict(dtype=args.dtype, attention_backend=args.attention_backend, max_num_seqs=max(args.prompts, args.batch),
                  max_model_len=max(args.ppl_tokens, args.context) + 256)
    results: dict = {"perplexity": {}, "greedy_agreement": {}, "pages_per_gib": {}}
    outputs = {}
    prompts = None
    for kv in ([] if args.only_step_time else ["auto", *formats]):
        t0 = time.perf_counter()
        llm = make_llm(args.model, kv, enforce_eager=True, kv_cache_memory_gb=1.0, **common)
        if prompts is None:
            all_ids = llm.get_tokenizer().encode(text)
            ids = all_ids[:args.ppl_tokens + 1]
            if len(ids) < args.ppl_tokens + 1:
                raise SystemExit(f"the text has only {len(all_ids)} tokens")
            stride = (len(all_ids) - 128) // args.prompts
            prompts = [all_ids[i * stride:i * stride + 32 + (i * 37) % 64] for i in range(args.prompts)]
        ppl = perplexity(llm, ids[:args.ppl_tokens + 1], args.chunk)
        outputs[kv] = greedy(llm, prompts, args.gen_tokens)
        results["perplexity"][kv] = ppl
        results["pages_per_gib"][kv] = llm.engine.runner.num_blocks
        if kv != "auto":
            results["greedy_agreement"][kv] = agreement(outputs["auto"], outputs[kv])
        base = results["perplexity"]["auto"]
        print(f"{kv}: ppl {ppl:.4f} ({100 * (ppl / base - 1):+.2f}%), pages/GiB {llm.engine.runner.num_blocks}, "
              f"{results['greedy_agreement'].get(kv, '')} ({time.perf_counter() - t0:.0f} s)", flush=True)
        del llm
    if args.only_step_time:
        results = {}
    else:
        base = results["perplexity"]["auto"]
        results["perplexity_delta_pct"] = {kv: 100 * (v / base - 1) for kv, v in results["perplexity"].items()}
        results["pages_per_gib_vs_auto"] = {kv: v / results["pages_per_gib"]["auto"]
                                            for kv, v in results["pages_per_gib"].items()}
        # "auto" is fp32 on a CPU without native bf16; the bf16 pool (GPUs, AMX CPUs) from the same arithmetic.
        from splitserve.cli.sizing import load_shape, pages_for
        bf16 = pages_for(1.0, load_shape(args.model), "bfloat16", 16)
        results["pages_per_gib_bf16"] = bf16
        results["pages_per_gib_vs_bf16"] = {kv: v / bf16 for kv, v in results["pages_per_gib"].items()}

    if not args.skip_step_time:
        pages = args.batch * (-(-(args.context + args.steps * args.rounds + 16) // 16)) + 64
        llms = {kv: make_llm(args.model, kv, num_gpu_blocks=pages, **common) for kv in ("auto", "int8")}
        results["step_time"] = {"batch": args.batch, "context": args.context,
                                **step_time(llms, args.batch, args.context, args.steps, args.rounds)}
        a, b = results["step_time"]["auto"]["median_ms"], results["step_time"]["int8"]["median_ms"]
        results["step_time"]["int8_vs_auto"] = b / a
        print(f"decode step batch {args.batch} x context {args.context}: auto {a:.1f} ms, int8 {b:.1f} ms "
              f"({b / a:.2f}x)", flush=True)
        backend = llms["auto"].engine.runner.backend.name
        model_dtype = str(llms["auto"].engine.runner.dtype)
        results["decode_kernel"] = kernel_time(llms["auto"].engine.runner.dtype, args.batch,
                                               [int(c) for c in args.kernel_contexts.split(",")], args.rounds)
    else:
        backend = model_dtype = None

    load.stop()
    write_json(args.out, {
        "load": load.summary(),
        "benchmark": "kv_quant",
        "config": {**vars(args), "attention_backend_used": backend, "model_dtype": model_dtype,
                   "text": "inspect.getsource(argparse)", "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
                   "text_tokens_used": args.ppl_tokens},
        "method": ("perplexity: the text prefilled in chunks through the paged engine (later chunks read earlier "
                   "quantized pages); agreement: greedy generate vs auto; step time: median engine.step() of "
                   "decodes over pages holding `context` tokens, auto and int8 engines interleaved by round"),
        **results,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
