"""Mixture-of-experts layers: how the engine runs a model's experts.

``transformers`` calls the experts of Mixtral, Qwen2/3-MoE, OLMoE and gpt-oss through its
``ExpertsInterface``: one function per implementation, given the module (its 3-D weights, its
gate), the hidden states and each token's top-k experts and weights. On CPU the engine keeps its
``grouped_mm`` (torch's grouped matmul). With the Triton kernels (the CUDA default, or
``--attention-backend triton``) it registers ``splitserve_triton``: the tokens sorted by expert
and each projection one grouped-GEMM launch over all experts (``triton_gemm``), the gate
(the module's own ``_apply_gate``: SwiGLU, gpt-oss's clamped one) and the routing weights in torch.
"""
from __future__ import annotations

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from splitserve.engine.experts.triton_gemm import tile_schedule  # also defines splitserve::moe_grouped_gemm

IMPLEMENTATION = "splitserve_triton"


def triton_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts of ``hidden_states`` [T, H] for ``top_k_index``/``top_k_weights`` [T, k], as
    ``transformers``' ``grouped_mm_experts_forward`` computes them."""
    num_tokens, top_k = top_k_index.shape
    expert_ids = top_k_index.reshape(-1)
    sorted_ids, order = torch.sort(expert_ids, stable=True)
    token_of_row = (order // top_k).to(torch.int32)
    counts = torch.zeros(self.num_experts, dtype=torch.int64, device=hidden_states.device)
    counts.scatter_add_(0, sorted_ids.to(torch.int64), torch.ones_like(sorted_ids, dtype=torch.int64))
    tiles = tile_schedule(counts, expert_ids.numel())
    rows = expert_ids.numel()
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    projected = torch.ops.splitserve.moe_grouped_gemm(hidden_states, token_of_row, up, up_bias, *tiles, rows,
                                                      self.is_transposed)
    projected = self._apply_gate(projected) if self.has_gate else self.act_fn(projected)
    down_bias = self.down_proj_bias if self.has_bias else None
    out = torch.ops.splitserve.moe_grouped_gemm(projected, None, self.down_proj, down_bias, *tiles, rows,
                                                self.is_transposed)
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    # Back to (token, k) order, and the k experts of each token summed.
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    return unsorted.view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, triton_experts_forward)


def use_triton_experts(model: torch.nn.Module) -> int:
    """Run every experts module of ``model`` through ``splitserve_triton``; returns how many."""
    n = 0
    for module in model.modules():
        if hasattr(module, "has_gate") and hasattr(module, "config") and hasattr(module, "down_proj"):
            module.config._experts_implementation = IMPLEMENTATION
            n += 1
    return n
