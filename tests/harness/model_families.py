"""Tiny random checkpoints of every architecture the engine's registry names (and of some it
refuses), built from a transformers config in the test: the same byte tokenizer as
``tiny_models``, two layers, and a wide init so that greedy decoding is not decided by float
rounding between near-tied tokens."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.harness.tiny_models import VOCAB_SIZE, byte_tokenizer

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
MAX_POSITIONS = 1024

# Architecture -> (config class, what differs from the common shape). Windows are set below the
# prompts the tests send where the architecture has one, so that a window the engine ignored
# would show.
FAMILIES: dict[str, tuple[str, dict]] = {
    "LlamaForCausalLM": ("LlamaConfig", {}),
    "Qwen2ForCausalLM": ("Qwen2Config", {"tie_word_embeddings": True}),
    "MistralForCausalLM": ("MistralConfig", {"head_dim": HEAD_DIM, "sliding_window": None}),
    "Qwen3ForCausalLM": ("Qwen3Config", {"head_dim": HEAD_DIM}),
    "GemmaForCausalLM": ("GemmaConfig", {"head_dim": HEAD_DIM}),
    "Phi3ForCausalLM": ("Phi3Config", {"sliding_window": None}),
    "Olmo2ForCausalLM": ("Olmo2Config", {}),
    "GraniteForCausalLM": ("GraniteConfig", {"logits_scaling": 4.0, "attention_multiplier": 0.2,
                                             "embedding_multiplier": 2.0, "residual_multiplier": 0.5}),
    "StableLmForCausalLM": ("StableLmConfig", {}),
    "MixtralForCausalLM": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                             "sliding_window": None}),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", {"head_dim": HEAD_DIM, "num_experts": 4, "num_experts_per_tok": 2,
                                               "moe_intermediate_size": 32, "decoder_sparse_step": 1}),
    "GPTNeoXForCausalLM": ("GPTNeoXConfig", {"rotary_pct": 0.5, "num_key_value_heads": None}),  # all heads
    # Refused (see the engine's registry): what each would need.
    "Gemma2ForCausalLM": ("Gemma2Config", {"head_dim": HEAD_DIM, "sliding_window": 16}),
    "MistralForCausalLM/window": ("MistralConfig", {"head_dim": HEAD_DIM, "sliding_window": 16}),
    "GptOssForCausalLM": ("GptOssConfig", {"head_dim": HEAD_DIM, "num_local_experts": 4, "num_experts_per_tok": 2,
                                           "sliding_window": 16}),
}


def make_family_model(path: Path, name: str, seed: int = 0) -> Path:
    """Save a tiny random model of ``name`` (a FAMILIES key) and the byte tokenizer into ``path``."""
    if (path / "config.json").exists():
        return path
    config_class, extra = FAMILIES[name]
    tokenizer = byte_tokenizer()
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POSITIONS,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    kwargs = {k: v for k, v in {**common, **extra}.items() if v is not None or k not in common}
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
