"""Speculative decoding on vs off: acceptance rate and output tokens/s, interleaved A/B.

Workloads, all requests submitted at once:

* ``copy``: prompts that quote a text and ask for it back (``Repeat the following text
  exactly``) or for a small edit of a code excerpt (rename an identifier): the output quotes
  the prompt, where prompt lookup pays. Texts are paragraphs of this repository's docs and
  functions of its engine, chat-templated for the instruct model; greedy, EOS honoured.
* ``mixed``: splitserve/cli/workloads.py's mixed workload (random prompt tokens of 32-256, outputs
  exponential mean 64, EOS ignored), where lookup rarely finds anything: the cost when it does
  not pay (in fact SmolLM2 loops on random tokens, so lookup pays there too).
* ``sampled``: the mixed workload at temperature 1 (seeded): outputs rarely repeat anything, so
  proposals are rejected or absent, and what speculation costs when it does not pay shows.

Method: two engines of the same config but speculation (``--speculative-method``, default
ngram with ``--num-speculative-tokens``); each runs one warm-up round of a workload, then
``--pairs`` measured rounds, the engines taking turns and alternating who goes first. Rounds
reuse their prompts, so both engines' later rounds hit the prefix cache alike: the figure is
mostly decode. Throughput = output tokens / wall time of the generate call; medians over
rounds. Acceptance = accepted / proposed tokens (vLLM's spec_decode counters). The greedy
outputs of both engines are compared token for token.

    nice -n 10 python -m bench.spec_decode --pairs 3 --out bench/results/spec_decode.json
"""
from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from bench.common import LoadSampler, median, write_json
from splitserve.cli.workloads import mixed

ROOT = Path(__file__).resolve().parents[1]


def copy_prompts(tokenizer, n: int) -> list[str]:
    """Alternately a docs paragraph to repeat and an engine function to edit, chat-templated."""
    text = (ROOT / "docs" / "request-lifecycle.md").read_text() + (ROOT / "docs" / "deploy.md").read_text()
    paragraphs = [p.strip() for p in text.split("\n\n") if 250 <= len(p.strip()) <= 700 and not p.startswith(("|", "```", "#"))]
    source = (ROOT / "engine" / "kv_cache_manager.py").read_text()
    functions = [f for f in re.findall(r"\n(    def \w+\(.*?)(?=\n    def |\n\n\n|\Z)", source, flags=re.S)
                 if 200 <= len(f) <= 900 and "owner" in f]
    prompts = []
    for i in range(n):
        if i % 2 == 0:
            ask = f"Repeat the following text exactly, word for word:\n\n{paragraphs[(i // 2) % len(paragraphs)]}"
        else:
            fn = functions[(i // 2) % len(functions)]
            ask = f"In the following Python method, rename the variable `owner` to `entry` and change nothing else. " \
                  f"Reply with the whole method only.\n\n```python\n{fn}\n```"
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False,
                                                     add_generation_prompt=True))
    return prompts


def spec_counters(llm) -> tuple[int, int, int]:
    s = llm.engine.scheduler.spec_stats
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


def run_round(llm, prompts, params) -> dict:
    before = spec_counters(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    after = spec_counters(llm)
    tokens = sum(len(o.token_ids) for o in outs)
    drafts, draft_tokens, accepted = (a - b for a, b in zip(after, before))
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall, "drafts": drafts,
            "draft_tokens": draft_tokens, "accepted_tokens": accepted, "outputs": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--speculative-method", default="ngram")
    ap.add_argument("--speculative-model", default=None)
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--workloads", default="copy,mixed")
    ap.add_argument("--n", type=int, default=8, help="requests per round")
    ap.add_argument("--copy-max-tokens", type=int, default=160)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/spec_decode.json")
    args = ap.parse_args()

    from splitserve.engine import LLM, SamplingParams
    common = dict(dtype=args.dtype, enforce_eager=args.enforce_eager, max_num_seqs=max(8, args.n))
    spec = dict(speculative_method=args.speculative_method, num_speculative_tokens=args.num_speculative_tokens,
                prompt_lookup_max=args.prompt_lookup_max, prompt_lookup_min=args.prompt_lookup_min,
                speculative_model=args.speculative_model)
    engines = {"off": LLM(args.model, **common), "on": LLM(args.model, **common, **spec)}
    tokenizer = engines["off"].get_tokenizer()
    load = LoadSampler()
    load.start()
    results = {}
    for name in args.workloads.split(","):
        if name == "copy":
            prompts = copy_prompts(tokenizer, args.n)
            params = SamplingParams(temperature=0.0, max_tokens=args.copy_max_tokens)
        elif name == "mixed":
            reqs = mixed(args.n, engines["off"].engine.vocab_size, seed=args.seed)
            prompts = [r.prompt_token_ids for r in reqs]
            params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
        elif name == "sampled":  # the mixed lengths at temperature 1: outputs rarely repeat, lookup rarely pays
            reqs = mixed(args.n, engines["off"].engine.vocab_size, seed=args.seed)
            prompts = [r.prompt_token_ids for r in reqs]
            params = [SamplingParams(temperature=1.0, seed=args.seed + i, max_tokens=r.max_tokens, ignore_eos=True)
                      for i, r in enumerate(reqs)]
        else:
            raise ValueError(f"unknown workload {name!r}")
        for arm in ("off", "on"):
            run_round(engines[arm], prompts, params)  # warm-up (and the prefix cache, alike for both)
        rounds = {"off": [], "on": []}
        for pair in range(args.pairs):
            for arm in (("off", "on") if pair % 2 == 0 else ("on", "off")):
                rounds[arm].append(run_round(engines[arm], prompts, params))
                r = rounds[arm][-1]
                print(f"{name} pair {pair} {arm}: {r['tokens_per_s']:.1f} tok/s, accepted {r['accepted_tokens']}"
                      f"/{r['draft_tokens']}", flush=True)
        on = rounds["on"]
        draft_tokens = sum(r["draft_tokens"] for r in on)
        accepted = sum(r["accepted_tokens"] for r in on)
        drafts = sum(r["drafts"] for r in on)
        same = sum(a == b for a, b in zip(rounds["off"][0]["outputs"], on[0]["outputs"]))
        off_tps = median([r["tokens_per_s"] for r in rounds["off"]])
        on_tps = median([r["tokens_per_s"] for r in on])
        results[name] = {
            "requests": args.n, "output_tokens_per_round": on[0]["output_tokens"],
            "tokens_per_s_off": off_tps, "tokens_per_s_on": on_tps, "speedup": on_tps / off_tps,
            "tokens_per_s_off_rounds": [r["tokens_per_s"] for r in rounds["off"]],
            "tokens_per_s_on_rounds": [r["tokens_per_s"] for r in on],
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_accepted_per_draft": accepted / drafts if drafts else 0.0,
            "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "outputs_identical": f"{same}/{len(on[0]['outputs'])}" if name != "sampled" else "n/a (sampled)",
        }
        print(name, {k: v for k, v in results[name].items() if not k.endswith("_rounds")}, flush=True)
    load.stop()
    write_json(args.out, {
        "benchmark": "speculative decoding on vs off, interleaved A/B (bench/spec_decode.py)",
        "model": args.model, "dtype": args.dtype, "compiled": not args.enforce_eager,
        "speculative": spec, "pairs": args.pairs, "results": results,
        "load": load.summary(),
    })


if __name__ == "__main__":
    main()
