"""Attention backends: C++ kernels on CPU, Triton kernels on CUDA, and a plain torch path."""
from __future__ import annotations

from splitserve.engine.attention.backend import AttentionBackend, StepLayout
from splitserve.engine.attention.torch_backend import TorchAttentionBackend


def select_backend(name: str, device_type: str, head_dim: int) -> AttentionBackend:
    """``auto`` takes Triton on CUDA and the C++ kernels on CPU (the torch path where they cannot
    be built or have no instance for ``head_dim``); asking for a backend that cannot run fails loudly."""
    if name == "auto":
        if device_type == "cuda":
            name = "triton"
        else:
            from splitserve.engine.attention import cpu_kernels
            name = "cpu" if head_dim in cpu_kernels.HEAD_DIMS and cpu_kernels.available() else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        from splitserve.engine.attention.cpu_backend import CpuAttentionBackend
        return CpuAttentionBackend()
    from splitserve.engine.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend()


__all__ = ["AttentionBackend", "StepLayout", "TorchAttentionBackend", "select_backend"]
