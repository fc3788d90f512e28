"""LoRA adapters served beside their base model, many in one batch.

* ``adapter`` -- reads an adapter in PEFT's format (``adapter_config.json`` and
  ``adapter_model.safetensors``) and checks it against the model it is meant for;
* ``layers`` -- ``LoRALinear``, which wraps each projection of the model: the base output plus the
  adapter's low-rank update, for every token with its own adapter, in two dense matmuls;
* ``manager`` -- ``LoRAManager``: which adapters the engine knows, which of them sit in the
  ``max_loras`` slots of the wrapped layers (least recently used out first), and each step's
  token-to-slot mask.
"""
