"""A mixture-of-experts model against a dense one of the same active parameters, through the engine.

Both are Qwen3-shaped and built from a config with random weights (``--load-format dummy``): the
MoE has ``--experts`` experts of width ``--moe-width``, ``--top-k`` of them per token, the dense
model one MLP of width top_k x moe_width, so a token's matmuls are the same size in both and
only the routing, the gather/scatter of tokens by expert and the grouped matmuls differ. Three
workloads, A and B interleaved round by round (A B, B A, ...), medians over ``--rounds``:
decode at batch 1 and at batch ``--batch`` (prompts of 32 tokens, ``--decode-tokens`` generated,
EOS ignored) and the prefill of one ``--prefill-tokens``-token prompt. The experts run as
``transformers`` runs them (``experts_implementation``, recorded: grouped matmuls, or a loop over
the experts, not over tokens, where torch's grouped matmul does not take the dtype).

    nice -n 10 python -m bench.moe_vs_dense --out bench/results/moe_vs_dense.json
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench.common import decode_rate, median, prefill_rate, write_json


def make_checkpoint(path: Path, moe: bool, args) -> Path:
    """config.json and a byte-level tokenizer: the engine builds the weights (load_format=dummy)."""
    import transformers

    from tests.harness.tiny_models import VOCAB_SIZE, byte_tokenizer
    tokenizer = byte_tokenizer()
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256), head_dim=64,
                  max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    if moe:
        config = transformers.Qwen3MoeConfig(num_experts=args.experts, num_experts_per_tok=args.top_k,
                                             moe_intermediate_size=args.moe_width, decoder_sparse_step=1,
                                             intermediate_size=args.top_k * args.moe_width, **common)
    else:
        config = transformers.Qwen3Config(intermediate_size=args.top_k * args.moe_width, **common)
    config.architectures = ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(config.to_json_string())
    tokenizer.save_pretrained(path)
    return path


def params(checkpoint: Path, args, moe: bool) -> dict:
    """Parameter counts of the model as transformers builds it (on the meta device: the engine's own
    copy has its linears packed for oneDNN, which hides them from parameters())."""
    import transformers
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(checkpoint))
    total = sum(p.numel() for p in model.parameters())
    if not moe:
        return {"total": total, "active_per_token": total}
    expert_params = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return {"total": total, "active_per_token": total - expert_params + expert_params * args.top_k // args.experts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-width", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/moe_vs_dense.json")
    args = ap.parse_args()

    from splitserve.engine import LLM
    root = Path(tempfile.mkdtemp(prefix="moe-bench-"))
    systems = {}
    for name, moe in (("dense", False), ("moe", True)):
        checkpoint = make_checkpoint(root / name, moe, args)
        llm = LLM(str(checkpoint), dtype=args.dtype, load_format="dummy", num_gpu_blocks=1024, block_size=16,
                  max_num_batched_tokens=max(512, args.prefill_tokens))
        model = llm.engine.runner.model
        systems[name] = {"llm": llm, "params": params(checkpoint, args, moe),
                         "experts_implementation": getattr(model.config, "_experts_implementation", None)}
        decode_rate(llm, 2, 4, seed=0)  # warm-up: the compile of each step shape
        prefill_rate(llm, args.prefill_tokens, seed=0)

    workloads = {"decode_batch1_tok_s": lambda llm, r: decode_rate(llm, 1, args.decode_tokens, r),
                 f"decode_batch{args.batch}_tok_s": lambda llm, r: decode_rate(llm, args.batch, args.decode_tokens, r),
                 f"prefill_{args.prefill_tokens}_tok_s": lambda llm, r: prefill_rate(llm, args.prefill_tokens, r)}
    samples = {name: {w: [] for w in workloads} for name in systems}
    for r in range(args.rounds):
        order = ["dense", "moe"] if r % 2 == 0 else ["moe", "dense"]
        for w, run in workloads.items():
            for name in order:
                samples[name][w].append(run(systems[name]["llm"], r + 1))
    result = {name: {"params": s["params"], "experts_implementation": s["experts_implementation"],
                     **{w: round(median(v), 1) for w, v in samples[name].items()},
                     "samples": samples[name]} for name, s in systems.items()}
    ratios = {w: round(median(samples["moe"][w]) / median(samples["dense"][w]), 3) for w in workloads}
    payload = {"what": "MoE vs dense of the same active parameters through the engine (tok/s, medians of "
                       "interleaved rounds; ratio = moe / dense)",
               "config": vars(args), "moe_over_dense": ratios, "systems": result}
    write_json(args.out, payload)
    print(ratios)
    for name in systems:
        print(name, {k: v for k, v in result[name].items() if k != "samples"})


if __name__ == "__main__":
    main()
