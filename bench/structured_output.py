"""What structured output costs per token: the grammar library's mask alone, then the engine.

1. ``mask``: for each grammar library installed (xgrammar, the one the engine uses; llguidance
   when present, for comparison), walk the tokens of a valid output of the JSON schema below
   and time, per token, filling the next-token bitmask for the model's vocabulary, applying it
   to one row of logits on the engine's device, and advancing the matcher.
2. ``sampler``: one sampler call for ``--batch`` greedy rows, every row constrained (a fresh
   matcher per row, walked along the sample output, each token accepted as decoding would) vs
   no row constrained: the whole per-step cost of structured output, median over the walk.
3. ``engine``: ``--batch`` chat prompts through ``LLM.generate``, greedy, once constrained by
   the schema and once unconstrained with ``ignore_eos`` and ``max_tokens`` equal to the longest
   constrained output (so both runs decode about as many steps); tokens/s of each, the arms
   alternating for ``--rounds`` rounds (medians).

    python -m bench.structured_output --batch 8 --out bench/results/structured_output.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from bench.common import git_commit, machine, median, write_json
from tests.harness.schemas import PERSON_SCHEMA

SCHEMA = PERSON_SCHEMA
SAMPLE = {"name": "Alice Smith", "age": 31, "city": "Paris", "admin": False}


def _walk(ids, fill, apply, accept, reps: int) -> dict:
    fills, applies, accepts = [], [], []
    for _ in range(reps):
        for t in ids:
            a = time.perf_counter()
            fill()
            b = time.perf_counter()
            apply()
            c = time.perf_counter()
            if not accept(t):
                raise RuntimeError(f"token {t} refused by the grammar")
            d = time.perf_counter()
            fills.append(b - a)
            applies.append(c - b)
            accepts.append(d - c)
    us = lambda xs: round(1e6 * median(xs), 1)  # noqa: E731
    return {"fill_us": us(fills), "apply_us": us(applies), "accept_us": us(accepts),
            "total_us": round(us(fills) + us(applies) + us(accepts), 1), "tokens": len(ids)}


def mask_costs(tokenizer, vocab: int, device: torch.device, reps: int) -> dict:
    text = json.dumps(SAMPLE)  # compact, as the engine's grammar writes it
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = [tokenizer.eos_token_id]
    out = {}
    import xgrammar as xgr
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=stop)
    info_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA),
                                                                                   any_whitespace=False)
    compile_s = time.perf_counter() - start
    logits = torch.randn(1, vocab, device=device)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    state = {}

    def fresh():
        state["m"] = xgr.GrammarMatcher(compiled)

    def x_apply():
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(device, non_blocking=True))
        if device.type == "cuda":
            torch.cuda.synchronize()

    runs = []
    for _ in range(reps):
        fresh()
        runs.append(_walk(ids, lambda: state["m"].fill_next_token_bitmask(bitmask),
                          x_apply, lambda t: state["m"].accept_token(t), 1))
    out["xgrammar"] = {**runs[-1], "tokenizer_info_s": round(info_s, 3), "compile_s": round(compile_s, 3)}
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lgt
    except ImportError:
        return out
    start = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    info_s = time.perf_counter() - start
    # Its default (flexible whitespace) also accepts the sample's ", " and ": " separators.
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    lbitmask = lgt.allocate_token_bitmask(1, vocab)

    def l_apply():  # the same apply kernel for both: this measures the matcher
        xgr.apply_token_bitmask_inplace(logits, lbitmask.to(device, non_blocking=True))
        if device.type == "cuda":
            torch.cuda.synchronize()

    runs = []
    for _ in range(reps):
        m = llguidance.LLMatcher(lt, grammar)
        runs.append(_walk(ids, lambda: lgt.fill_next_token_bitmask(m, lbitmask, 0), l_apply,
                          lambda t: m.consume_token(t), 1))
    out["llguidance"] = {**runs[-1], "tokenizer_info_s": round(info_s, 3)}
    return out


def sampler_overhead(tokenizer, vocab: int, device: torch.device, batch: int, reps: int) -> dict:
    from splitserve.engine.sampler import Sampler, SamplingRow
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.engine.grammar import GrammarCompiler
    from splitserve.engine.structured_output import StructuredOutput

    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    ids = tokenizer.encode(json.dumps(SAMPLE), add_special_tokens=False)
    sampler = Sampler([tokenizer.eos_token_id])
    logits = torch.randn(batch, vocab, device=device)
    constrained = SamplingParams(temperature=0, max_tokens=64, structured_output=spec)
    free = [SamplingRow(SamplingParams(temperature=0, max_tokens=64), [], [])] * batch
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with_s, without_s = [], []
    for _ in range(reps):
        grammars = [compiler.grammar(spec) for _ in range(batch)]
        for t in ids:
            rows = [SamplingRow(constrained, [], [], None, g) for g in grammars]
            sync()
            a = time.perf_counter()
            sampler(logits, rows)  # .tolist() inside waits for the device
            for g in grammars:
                g.accept(t)
            b = time.perf_counter()
            sampler(logits, free)
            c = time.perf_counter()
            with_s.append(b - a)
            without_s.append(c - b)
    w, wo = median(with_s), median(without_s)
    return {"batch": batch, "with_grammar_ms": round(1e3 * w, 3), "without_grammar_ms": round(1e3 * wo, 3),
            "overhead_us_per_row": round(1e6 * (w - wo) / batch, 1)}


def engine_throughput(model: str, batch: int, max_tokens: int, rounds: int) -> dict:
    from splitserve.engine import LLM, SamplingParams
    from splitserve.engine.structured_output import StructuredOutput
    llm = LLM(model, dtype="float32", max_num_seqs=max(batch, 8))
    tok = llm.get_tokenizer()
    names = ["Alice", "Bob", "Chen", "Dmitri", "Eve", "Fatima", "Gabriel", "Hana", "Ivan", "Jun", "Kofi", "Lena"]
    prompts = [tok.apply_chat_template(
        [{"role": "user", "content": f"Write a JSON record for a user called {names[i % len(names)]} {i}."}],
        add_generation_prompt=True, tokenize=False) for i in range(batch)]
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))
    # Warm-up with the whole batch, both ways: compiles the step for these shapes, builds the
    # tokenizer table, compiles the grammar; none of it is counted below.
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, structured_output=spec))
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))

    # The arms alternate, round after round (medians reported): on shared cores the load
    # changes by the minute, and one run of each would measure that instead.
    constrained = SamplingParams(temperature=0, max_tokens=max_tokens, structured_output=spec)
    outs = llm.generate(prompts, constrained)
    valid = sum(1 for o in outs if _valid(o.text))
    longest = max(len(o.token_ids) for o in outs)
    free = SamplingParams(temperature=0, max_tokens=longest, ignore_eos=True)
    rates: dict[str, list[float]] = {"with_grammar": [], "without_grammar": []}
    tokens = {}
    for _ in range(rounds):
        for arm, params in (("with_grammar", constrained), ("without_grammar", free)):
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            tokens[arm] = sum(len(o.token_ids) for o in outs)
            rates[arm].append(round(tokens[arm] / seconds, 1))
    return {"batch": batch, "device": str(llm.engine.runner.device), "rounds": rounds,
            "with_grammar": {"tokens": tokens["with_grammar"], "tokens_per_s": median(rates["with_grammar"]),
                             "rounds_tokens_per_s": rates["with_grammar"], "valid_outputs": valid},
            "without_grammar": {"tokens": tokens["without_grammar"], "tokens_per_s": median(rates["without_grammar"]),
                                "rounds_tokens_per_s": rates["without_grammar"]}}


def _valid(text: str) -> bool:
    try:
        import jsonschema
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except Exception:  # noqa: BLE001 -- counted, not raised: the bench reports it
        return False


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5, help="walks of the sample output per library")
    ap.add_argument("--rounds", type=int, default=3, help="alternating engine runs per arm")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from splitserve.engine.model_loader import load_config, load_tokenizer, resolve_model
    from splitserve.engine.model_runner import resolve_device
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    vocab = load_config(model_dir).vocab_size
    device = resolve_device("auto")
    result = {"bench": "structured_output", "commit": git_commit(), "machine": machine(), "model": args.model,
              "vocab_size": vocab, "schema": SCHEMA,
              "mask_per_token": mask_costs(tokenizer, vocab, device, args.reps)}
    for lib, r in result["mask_per_token"].items():
        print(f"{lib:11s} per token on {device}: fill {r['fill_us']} us, apply {r['apply_us']} us, "
              f"accept {r['accept_us']} us (total {r['total_us']} us)")
    s = result["sampler"] = sampler_overhead(tokenizer, vocab, device, args.batch, args.reps)
    print(f"sampler, batch {s['batch']} on {device}: {s['with_grammar_ms']} ms with every row constrained, "
          f"{s['without_grammar_ms']} ms without ({s['overhead_us_per_row']} us per constrained row)")
    if not args.skip_engine:
        e = result["engine"] = engine_throughput(args.model, args.batch, args.max_tokens, args.rounds)
        print(f"engine, batch {e['batch']} on {e['device']}: {e['with_grammar']['tokens_per_s']} tokens/s with the "
              f"schema ({e['with_grammar']['valid_outputs']}/{e['batch']} valid), "
              f"{e['without_grammar']['tokens_per_s']} tokens/s without")
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
