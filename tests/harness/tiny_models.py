"""Tiny random-initialised checkpoints (Llama, Qwen2, Mistral) with a byte-level tokenizer, built in-test."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)

SPECIALS = ["<bos>", "<eos>", "<pad>"]
VOCAB_SIZE = 256 + len(SPECIALS)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    byte_to_unicode = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_to_unicode))}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>")


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                    intermediate_size: int = 128) -> Path:
    """Save a tiny random model + tokenizer into ``path`` (once) and return it."""
    if (path / "config.json").exists():
        return path
    tokenizer = byte_tokenizer()
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=num_heads * head_dim, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, max_position_embeddings=1024,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, head_dim=head_dim, sliding_window=None))
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    # A wider init than the default 0.02 gives confident logits, so greedy comparisons test
    # the engine rather than float rounding between near-tied tokens.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
