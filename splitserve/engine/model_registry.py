"""Which model architectures the engine serves exactly, and the refusal of every other one.

The engine runs a checkpoint through its ``transformers`` modules with the paged attention op in
place of theirs (``attention/hf_integration.py``). That is exact only for what the op and the
runner implement: causal attention with the layer's own scale, sliding window, soft-capping of
scores and attention sinks (each layer its own, as transformers passes them), any head size the
kernels take, grouped KV heads and the model's own rotary embedding, q/k norms and MLPs (dense or
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
    # Whether its MLPs are experts stored as 3-D tensors (they keep float weights under --quantization).
    experts: bool = False


SUPPORTED: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("Llama 2 / 3, SmolLM2", "meta-llama/Llama-3.1-8B-Instruct"),
    "MistralForCausalLM": Architecture("Mistral", "mistralai/Mistral-7B-Instruct-v0.1", "sliding window"),
    "Qwen2ForCausalLM": Architecture("Qwen2, Qwen2.5", "Qwen/Qwen2.5-7B-Instruct",
                                     "q/k/v biases; sliding window in the upper layers when use_sliding_window"),
    "Qwen3ForCausalLM": Architecture("Qwen3", "Qwen/Qwen3-8B", "q/k norms"),
    "Qwen3MoeForCausalLM": Architecture("Qwen3-MoE", "Qwen/Qwen3-30B-A3B", "mixture of experts", experts=True),
    "MixtralForCausalLM": Architecture("Mixtral", "mistralai/Mixtral-8x7B-Instruct-v0.1",
                                       "mixture of experts; sliding window", experts=True),
    "GemmaForCausalLM": Architecture("Gemma", "google/gemma-7b-it", "GeGLU, scaled embeddings"),
    "Gemma2ForCausalLM": Architecture("Gemma 2", "google/gemma-2-9b-it",
                                      "sliding-window and full layers alternating, soft-capped attention scores "
                                      "and logits, query_pre_attn_scalar, post-norms"),
    "Gemma3ForCausalLM": Architecture("Gemma 3 (text)", "google/gemma-3-1b-it",
                                      "five sliding-window layers to one full, q/k norms, a rotary base per "
                                      "layer type"),
    "GptOssForCausalLM": Architecture("gpt-oss", "openai/gpt-oss-20b",
                                      "attention sinks, sliding-window and full layers alternating, mixture of "
                                      "experts (the bf16 release: MXFP4 checkpoints are refused at load)",
                                      experts=True),
    "Phi3ForCausalLM": Architecture("Phi-3", "microsoft/Phi-3-mini-4k-instruct",
                                    "fused qkv and gate/up; sliding window"),
    "Olmo2ForCausalLM": Architecture("OLMo 2", "allenai/OLMo-2-1124-7B-Instruct", "q/k norms, post-norms"),
    "GraniteForCausalLM": Architecture("Granite", "ibm-granite/granite-3.1-8b-instruct",
                                       "attention, embedding, residual and logits multipliers"),
    "StableLmForCausalLM": Architecture("StableLM", "stabilityai/stablelm-2-1_6b-chat", "partial rotary"),
    "Qwen2MoeForCausalLM": Architecture("Qwen2-MoE, Qwen1.5-MoE", "Qwen/Qwen1.5-MoE-A2.7B-Chat",
                                        "mixture of experts with a gated shared expert; q/k/v biases", experts=True),
    "OlmoeForCausalLM": Architecture("OLMoE", "allenai/OLMoE-1B-7B-0125-Instruct", "mixture of experts, q/k norms",
                                     experts=True),
    "PhiForCausalLM": Architecture("Phi-1.5, Phi-2", "microsoft/phi-2",
                                   "partial rotary, parallel attention and MLP, biases"),
    "CohereForCausalLM": Architecture("Command R", "CohereForAI/c4ai-command-r-v01",
                                      "parallel attention and MLP, layer norms, logit_scale"),
    "Cohere2ForCausalLM": Architecture("Command R7B, Command A", "CohereForAI/c4ai-command-r7b-12-2024",
                                       "three sliding-window layers to one full (no rotary in the full ones)"),
    "GPTNeoXForCausalLM": Architecture("GPT-NeoX, Pythia", "EleutherAI/pythia-1.4b",
                                       "partial rotary, parallel residual, fused qkv"),
}

# Architectures people ask for that the engine refuses, and why (anything unlisted gets the
# generic reason).
REFUSED: dict[str, str] = {
    "Gemma3ForConditionalGeneration": "a vision tower (multimodal)",
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


def check_supported(hf_config) -> None:
    """Raise ``UnsupportedModel`` unless the engine serves this model exactly."""
    arch = architecture_of(hf_config)
    if arch not in SUPPORTED:
        reason = REFUSED.get(arch, "an architecture nobody has checked against transformers here")
        raise UnsupportedModel(f"{arch} is not supported: it needs {reason}, which this engine does not implement "
                               f"(supported: {', '.join(sorted(SUPPORTED))}; docs/models.md)")
    quantization_to_load(hf_config, None)


def quantization_to_load(hf_config, requested: str | None) -> str | None:
    """The quantization to load this checkpoint with: ``requested`` (``--quantization``), or the
    checkpoint's own ``quant_method`` where it is a format this engine reads as shipped (GPTQ,
    AWQ); ``UnsupportedModel`` for any other quantized checkpoint, or a request that contradicts it."""
    from splitserve.engine.config import CHECKPOINT_QUANTIZATIONS

    quantization = getattr(hf_config, "quantization_config", None)
    if not quantization:
        return requested
    method = quantization.get("quant_method") if isinstance(quantization, dict) else \
        getattr(quantization, "quant_method", None)
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    arch = architecture_of(hf_config)
    if method not in CHECKPOINT_QUANTIZATIONS:  # e.g. gpt-oss's MXFP4 experts: transformers would de-quantize
        raise UnsupportedModel(f"{arch} with quantized weights (quant_method={method}) is not supported: this "
                               f"engine reads {', '.join(CHECKPOINT_QUANTIZATIONS)} checkpoints as shipped and "
                               "unquantized ones (the bf16 or fp32 release of the model; --quantization int8 or "
                               "fp8 quantizes it at load)")
    if requested not in (None, method):
        raise UnsupportedModel(f"this checkpoint is quantized with {method}; --quantization {requested} cannot apply "
                               f"to it (leave the flag unset, or set it to {method})")
    return method


def final_logits(hf_config) -> Callable[["torch.Tensor"], "torch.Tensor"] | None:
    """What the model's head does to its logits after the output projection, as ``transformers``
    does it (greedy choices do not change, sampling and logprobs do); None when nothing."""
    scaling = getattr(hf_config, "logits_scaling", None)  # Granite
    softcap = getattr(hf_config, "final_logit_softcapping", None)  # Gemma 2/3
    multiplier = getattr(hf_config, "logit_scale", None)  # Cohere
    if scaling and scaling != 1.0:
        return lambda logits: logits / scaling
    if multiplier and multiplier != 1.0:
        return lambda logits: logits * multiplier
    if softcap:
        return lambda logits: (logits / softcap).tanh() * softcap
    return None
