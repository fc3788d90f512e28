"""Attention backends: a torch reference path (CPU) and Triton kernels (CUDA)."""
from __future__ import annotations

from engine.attention.backend import AttentionBackend, StepLayout
from engine.attention.torch_backend import TorchAttentionBackend


def select_backend(name: str, device_type: str) -> AttentionBackend:
    """``auto`` takes Triton on CUDA and torch elsewhere; asking for Triton where it cannot run fails loudly."""
    if name == "auto":
        name = "triton" if device_type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    from engine.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend()


__all__ = ["AttentionBackend", "StepLayout", "TorchAttentionBackend", "select_backend"]
