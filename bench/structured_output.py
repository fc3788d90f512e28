"""What structured output costs per token: the grammar library's mask alone, then the engine.

1. ``mask``: for each grammar library installed (xgrammar, the one the engine uses; llguidance
   when present, for comparison), walk the tokens of a valid output of the JSON schema below
   and time, per token, filling the next-token bitmask for the model's vocabulary, applying it
   to one row of logits on the engine's device, and advancing the matcher.
2. ``engine``: ``--batch`` chat prompts through ``LLM.generate``, greedy, once constrained by
   the schema and once unconstrained with ``ignore_eos`` and ``max_tokens`` equal to the longest
   constrained output (so both runs decode about as many steps); tokens/s of each.

    python -m bench.structured_output --batch 8 --out bench/results/structured_output.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from bench.common import git_commit, machine, median, write_json

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "Lima"]},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "admin"],
}
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


def engine_throughput(model: str, batch: int, max_tokens: int) -> dict:
    from engine import LLM, SamplingParams
    from engine.structured_output import StructuredOutput
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

    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, structured_output=spec))
    with_s = time.perf_counter() - start
    with_tokens = sum(len(o.token_ids) for o in outs)
    valid = sum(1 for o in outs if _valid(o.text))
    longest = max(len(o.token_ids) for o in outs)

    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=longest, ignore_eos=True))
    without_s = time.perf_counter() - start
    without_tokens = sum(len(o.token_ids) for o in outs)
    return {"batch": batch, "device": str(llm.engine.runner.device),
            "with_grammar": {"tokens": with_tokens, "seconds": round(with_s, 3),
                             "tokens_per_s": round(with_tokens / with_s, 1), "valid_outputs": valid},
            "without_grammar": {"tokens": without_tokens, "seconds": round(without_s, 3),
                                "tokens_per_s": round(without_tokens / without_s, 1)}}


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
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from engine.model_loader import load_config, load_tokenizer, resolve_model
    from engine.model_runner import resolve_device
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
    if not args.skip_engine:
        e = result["engine"] = engine_throughput(args.model, args.batch, args.max_tokens)
        print(f"engine, batch {e['batch']} on {e['device']}: {e['with_grammar']['tokens_per_s']} tokens/s with the "
              f"schema ({e['with_grammar']['valid_outputs']}/{e['batch']} valid), "
              f"{e['without_grammar']['tokens_per_s']} tokens/s without")
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
