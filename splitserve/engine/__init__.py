"""splitserve engine: paged KV cache, continuous batching, a transformers-backed model runner.

Names are imported lazily so that pure-Python parts (the KV cache manager) load without torch.
"""
from importlib import import_module

_EXPORTS = {
    "LLM": "splitserve.engine.llm",
    "LLMEngine": "splitserve.engine.llm_engine",
    "EngineConfig": "splitserve.engine.config",
    "RequestOutput": "splitserve.engine.outputs",
    "SamplingParams": "splitserve.engine.sampling_params",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
