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
# Below the prompts the tests send (5-60 tokens), so that a window the engine ignored would show.
WINDOW = 16

# Architecture -> (config class, what differs from the common shape). Gemmas' embeddings are
# untied: tied and scaled by sqrt(hidden), they made greedy repeat the input token (97 % of
# positions for Gemma 3), whatever the attention did.
FAMILIES: dict[str, tuple[str, dict]] = {
    "LlamaForCausalLM": ("LlamaConfig", {}),
    # The second layer windowed, the first not (use_sliding_window from max_window_layers on).
    "Qwen2ForCausalLM": ("Qwen2Config", {"tie_word_embeddings": True, "use_sliding_window": True,
                                         "sliding_window": WINDOW, "max_window_layers": 1}),
    "MistralForCausalLM": ("MistralConfig", {"head_dim": HEAD_DIM, "sliding_window": WINDOW}),
    "Qwen3ForCausalLM": ("Qwen3Config", {"head_dim": HEAD_DIM}),
    "GemmaForCausalLM": ("GemmaConfig", {"head_dim": HEAD_DIM, "tie_word_embeddings": False}),
    "Phi3ForCausalLM": ("Phi3Config", {"sliding_window": WINDOW}),
    "Olmo2ForCausalLM": ("Olmo2Config", {}),
    "GraniteForCausalLM": ("GraniteConfig", {"logits_scaling": 4.0, "attention_multiplier": 0.2,
                                             "embedding_multiplier": 2.0, "residual_multiplier": 0.5}),
    "StableLmForCausalLM": ("StableLmConfig", {}),
    "MixtralForCausalLM": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                             "sliding_window": WINDOW}),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", {"head_dim": HEAD_DIM, "num_experts": 4, "num_experts_per_tok": 2,
                                               "moe_intermediate_size": 32, "decoder_sparse_step": 1}),
    "GPTNeoXForCausalLM": ("GPTNeoXConfig", {"rotary_pct": 0.5, "num_key_value_heads": None}),  # all heads
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                               "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1}),
    "OlmoeForCausalLM": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
    "PhiForCausalLM": ("PhiConfig", {"partial_rotary_factor": 0.5, "num_key_value_heads": None}),
    "CohereForCausalLM": ("CohereConfig", {"logit_scale": 0.5}),
    "Cohere2ForCausalLM": ("Cohere2Config", {"sliding_window": WINDOW, "logit_scale": 0.5,
                                             "layer_types": ["sliding_attention", "full_attention"]}),
    # Windowed and full layers alternating; soft-capped scores (a cap that bites at these scales)
    # and logits; a query_pre_attn_scalar that is not the head size.
    "Gemma2ForCausalLM": ("Gemma2Config", {"head_dim": HEAD_DIM, "sliding_window": WINDOW,
                                           "tie_word_embeddings": False,
                                           "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0,
                                           "query_pre_attn_scalar": 24}),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", {"head_dim": HEAD_DIM, "sliding_window": WINDOW,
                                               "tie_word_embeddings": False,
                                               "layer_types": ["sliding_attention", "full_attention"]}),
    "GptOssForCausalLM": ("GptOssConfig", {"head_dim": HEAD_DIM, "num_local_experts": 4, "num_experts_per_tok": 2,
                                           "sliding_window": WINDOW,
                                           "layer_types": ["sliding_attention", "full_attention"]}),
}


def make_family_model(path: Path, name: str, seed: int = 0, **overrides) -> Path:
    """Save a tiny random model of ``name`` (a FAMILIES key) and the byte tokenizer into ``path``;
    ``overrides``: config fields to set otherwise (e.g. more layers)."""
    if (path / "config.json").exists():
        return path
    config_class, extra = FAMILIES[name]
    tokenizer = byte_tokenizer()
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POSITIONS,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    kwargs = {k: v for k, v in {**common, **extra, **overrides}.items() if v is not None or k not in common}
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
            elif param_name.endswith("sinks"):  # gpt-oss: a logit per head, zero at init (no effect to see)
                p.normal_(0.0, 1.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
