"""Tensor parallelism on this machine: one engine at TP=2 (two rank processes, one thread each)
against the same engine at TP=1 (one process, a thread per core), interleaved, same requests.

SmolLM2-135M's 9 attention heads and 3 KV heads do not split in two, so this measures a model of
its size and shape that does: random weights (throughput does not depend on them), 30 layers,
hidden 576 as 9 x 64 becomes 8 x 64 = 512 with 2 KV heads, MLP 1,536, SmolLM2's vocabulary and
tokenizer; built once under the engine's cache. Greedy, EOS ignored, exact lengths, as
``bench.engine_throughput`` (which does the measuring) always runs.

    python -m bench.tensor_parallel --out bench/results/tensor_parallel.json \\
        --workload mixed,prefill --prompt-lens 1024 --num-requests 32 --pairs 3
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def model_dir() -> Path:
    """The random SmolLM2-sized checkpoint with heads that split in two (made on first use)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from splitserve.engine.model_loader import cache_dir, load_config, resolve_model
    target = cache_dir() / "models" / "bench-tp-smollm2-shape"
    if (target / "config.json").exists():
        return target
    smollm2 = resolve_model("smollm2-135m-instruct")
    base = load_config(smollm2)
    config = LlamaConfig(vocab_size=base.vocab_size, hidden_size=512, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                         rope_theta=getattr(base, "rope_theta", 10000.0), tie_word_embeddings=True,
                         bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, tmp / name)
    shutil.copy(smollm2 / "generation_config.json", tmp / "generation_config.json")
    tmp.rename(target)
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workload", default="mixed,prefill")
    parser.add_argument("--prompt-lens", default="1024")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args(argv)
    from bench import engine_throughput
    return engine_throughput.main(["--out", args.out, "--model", str(model_dir()), "--workload", args.workload,
                                   "--prompt-lens", args.prompt_lens, "--num-requests", str(args.num_requests),
                                   "--pairs", str(args.pairs), "--systems", "splitserve,splitserve-tp2"])


if __name__ == "__main__":
    from splitserve.cli.allocator import restart_with_tcmalloc
    restart_with_tcmalloc()  # as the workers run (splitserve/cli/allocator.py)
    sys.exit(main())
