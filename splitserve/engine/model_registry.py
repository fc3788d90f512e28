"""Which model architectures the engine serves exactly, and the refusal of every other one.

The engine runs a checkpoint through its ``transformers`` modules with the paged attention op in
place of theirs (``attention/hf_integration.py``). That is exact only for what the op and the
runner implement: causal attention over every earlier token, with the layer's own scale, any
head size, grouped KV heads and the model's own rotary embedding, q/k norms and MLPs (dense or
experts, run as ``transformers`` writes them). A feature outside that would run without error and
give other tokens, so a model is checked against this registry from its config alone, before a
weight is loaded, and refused with the architecture and the missing feature named.

Each architecture listed here has a test that builds a tiny random model of it and compares the
engine's greedy output with ``transformers`` token for token (``tests/test_model_families.py``);
``docs/models.md`` is generated from this table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Architecture:
    # What people call the family.
    family: str
    # A checkpoint of it on the Hugging Face hub.
    example: str
    # What it brings beyond a Llama-style decoder, for the table.
    features: str = ""


SUPPORTED: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("Llama 2 / 3, SmolLM2", "meta-llama/Llama-3.1-8B-Instruct"),
    "MistralForCausalLM": Architecture("Mistral", "mistralai/Mistral-7B-Instruct-v0.3",
                                       "sliding window only up to --max-model-len"),
    "Qwen2ForCausalLM": Architecture("Qwen2, Qwen2.5", "Qwen/Qwen2.5-7B-Instruct", "q/k/v biases"),
    "Qwen3ForCausalLM": Architecture("Qwen3", "Qwen/Qwen3-8B", "q/k norms"),
    "Qwen3MoeForCausalLM": Architecture("Qwen3-MoE", "Qwen/Qwen3-30B-A3B", "mixture of experts"),
    "MixtralForCausalLM": Architecture("Mixtral", "mistralai/Mixtral-8x7B-Instruct-v0.1",
                                       "mixture of experts; sliding window only up to --max-model-len"),
    "GemmaForCausalLM": Architecture("Gemma", "google/gemma-7b-it", "GeGLU, scaled embeddings"),
    "Phi3ForCausalLM": Architecture("Phi-3", "microsoft/Phi-3-mini-4k-instruct",
                                    "fused qkv and gate/up; sliding window only up to --max-model-len"),
    "Olmo2ForCausalLM": Architecture("OLMo 2", "allenai/OLMo-2-1124-7B-Instruct", "q/k norms, post-norms"),
    "GraniteForCausalLM": Architecture("Granite", "ibm-granite/granite-3.1-8b-instruct",
                                       "attention, embedding, residual and logits multipliers"),
    "StableLmForCausalLM": Architecture("StableLM", "stabilityai/stablelm-2-1_6b-chat", "partial rotary"),
    "GPTNeoXForCausalLM": Architecture("GPT-NeoX, Pythia", "EleutherAI/pythia-1.4b",
                                       "partial rotary, parallel residual, fused qkv"),
}

# Architectures people ask for that the engine refuses, and why (anything unlisted gets the
# generic reason).
REFUSED: dict[str, str] = {
    "Gemma2ForCausalLM": "soft-capping of attention scores, and sliding-window layers",
    "Gemma3ForCausalLM": "sliding-window layers",
    "Gemma3ForConditionalGeneration": "a vision tower (multimodal), and sliding-window layers",
    "GptOssForCausalLM": "attention sinks, and sliding-window layers",
    "Cohere2ForCausalLM": "sliding-window layers",
    "DeepseekV2ForCausalLM": "multi-head latent attention (MLA)",
    "DeepseekV3ForCausalLM": "multi-head latent attention (MLA)",
    "MambaForCausalLM": "state-space layers (no attention KV cache)",
    "Mamba2ForCausalLM": "state-space layers (no attention KV cache)",
    "JambaForCausalLM": "hybrid state-space and attention layers",
    "FalconMambaForCausalLM": "state-space layers (no attention KV cache)",
    "T5ForConditionalGeneration": "an encoder-decoder (cross-attention)",
    "BartForConditionalGeneration": "an encoder-decoder (cross-attention)",
    "LlavaForConditionalGeneration": "a vision tower (multimodal)",
    "Qwen2VLForConditionalGeneration": "a vision tower (multimodal)",
}


class UnsupportedModel(ValueError):
    """The checkpoint needs something the engine does not implement (its message says what)."""


def architecture_of(hf_config) -> str:
    names = getattr(hf_config, "architectures", None) or []
    return names[0] if names else type(hf_config).__name__.removesuffix("Config") + " (no architectures in config.json)"


def sliding_window(hf_config) -> int | None:
    """The attention window of the model's windowed layers, if any of them has one."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    return int(window)


def check_supported(hf_config, max_model_len: int) -> None:
    """Raise ``UnsupportedModel`` unless the engine serves this model exactly up to
    ``max_model_len`` tokens."""
    arch = architecture_of(hf_config)
    if arch not in SUPPORTED:
        reason = REFUSED.get(arch, "an architecture nobody has checked against transformers here")
        raise UnsupportedModel(f"{arch} is not supported: it needs {reason}, which this engine does not implement "
                               f"(supported: {', '.join(sorted(SUPPORTED))}; docs/models.md)")
    if getattr(hf_config, "attn_logit_softcapping", None):
        raise UnsupportedModel(f"{arch} with attn_logit_softcapping is not supported: soft-capping of attention "
                               "scores is not implemented")
    window = sliding_window(hf_config)
    if window is not None and window < max_model_len:
        raise UnsupportedModel(
            f"{arch} with sliding_window={window} is not supported beyond {window} tokens: sliding-window "
            f"attention is not implemented, and max_model_len is {max_model_len}. With --max-model-len {window} "
            "or less the window never applies and the model is served exactly")


def final_logits(hf_config) -> Callable[["torch.Tensor"], "torch.Tensor"] | None:
    """What the model's head does to its logits after the output projection, as ``transformers``
    does it (greedy choices do not change, sampling and logprobs do); None when nothing."""
    scaling = getattr(hf_config, "logits_scaling", None)  # Granite
    softcap = getattr(hf_config, "final_logit_softcapping", None)  # Gemma 2/3
    if scaling and scaling != 1.0:
        return lambda logits: logits / scaling
    if softcap:
        return lambda logits: (logits / softcap).tanh() * softcap
    return None
