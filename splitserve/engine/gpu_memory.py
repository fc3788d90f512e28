"""Sizing the KV pool from ``gpu_memory_utilization``, as vLLM does: a share of the GPU per process.

Two workers can share one GPU (the single-GPU disaggregated mode: a prefill and a decode process,
KV over CUDA IPC) only if each stays inside its share. A worker with
``gpu_memory_utilization = u`` may hold ``u x`` the GPU's total memory: its weights, the peak of
one full step (a prefill of ``max_num_batched_tokens`` tokens, measured by running it once with a
scratch pool, as vLLM's profile run does), memory torch's allocator does not see (the CUDA
context, cuBLAS and Triton modules: ``NON_TORCH_BYTES``, not measurable per process while another
process shares the GPU) and the KV pool, which gets the rest.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

GIB = 1 << 30
# What the CUDA context and libraries hold outside torch's allocator, set aside per process.
NON_TORCH_BYTES = 1 * GIB


def kv_blocks_for_budget(total_bytes: int, utilization: float, used_bytes: int, bytes_per_block: int,
                         free_bytes: int | None = None) -> int:
    """KV pages that fit in ``utilization`` of ``total_bytes`` once ``used_bytes`` are taken.

    ``free_bytes`` (what the GPU has free now): the pool must also fit there, else another process
    holds more than the shares leave it."""
    budget = int(utilization * total_bytes)
    kv_bytes = budget - used_bytes
    if kv_bytes < bytes_per_block:
        raise ValueError(f"gpu_memory_utilization={utilization} allows {budget / GIB:.2f} GiB of this GPU's "
                         f"{total_bytes / GIB:.2f} GiB, but the model, one step and the CUDA context already take "
                         f"{used_bytes / GIB:.2f} GiB: no room for a KV pool; raise it")
    if free_bytes is not None and kv_bytes > free_bytes:
        raise ValueError(f"gpu_memory_utilization={utilization} wants a {kv_bytes / GIB:.2f} GiB KV pool but the GPU "
                         f"has {free_bytes / GIB:.2f} GiB free: other processes use more than their share; lower "
                         "it or stop them (the shares of processes on one GPU must add up to at most 1)")
    return kv_bytes // bytes_per_block


@torch.inference_mode()
def profile_step_bytes(runner) -> int:
    """Peak bytes torch holds on the runner's GPU through one full-budget prefill step and the
    sampling of ``max_num_seqs`` rows, with the weights loaded and no KV pool yet."""
    from splitserve.engine.attention import StepLayout
    from splitserve.engine.attention.hf_integration import StepContext, step_context

    device, config = runner.device, runner.config
    tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
    blocks = -(-tokens // runner.block_size)
    scratch = torch.zeros((runner.num_layers, 2, blocks, runner.block_size, runner.num_kv_heads, runner.kv_row),
                          dtype=runner.kv_dtype, device=device)
    caches = [(scratch[i, 0], scratch[i, 1]) for i in range(runner.num_layers)]
    layout = StepLayout(slot_mapping=torch.arange(tokens, device=device),
                        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=device),
                        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=device),
                        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
                        num_decodes=0, query_lens_list=[tokens], seq_lens_list=[tokens],
                        block_size=runner.block_size)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    with step_context(StepContext(runner.backend, layout, runner.backend.prepare(layout), caches)):
        hidden = runner.decoder(input_ids=torch.zeros(1, tokens, dtype=torch.int64, device=device),
                                position_ids=torch.arange(tokens, device=device)[None],
                                use_cache=False).last_hidden_state[0]
    runner.head(hidden[:config.max_num_seqs]).float().softmax(-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device)
    del scratch, caches, hidden
    torch.cuda.empty_cache()
    return peak


def kv_blocks_for_utilization(runner, utilization: float, bytes_per_block: int) -> int:
    device = runner.device
    step_bytes = profile_step_bytes(runner)
    free, total = torch.cuda.mem_get_info(device)
    blocks = kv_blocks_for_budget(total, utilization, step_bytes + NON_TORCH_BYTES, bytes_per_block, free)
    log.info("gpu_memory_utilization %.2f of %.1f GiB: weights + one step %.2f GiB, %.2f GiB set aside for the CUDA "
             "context, %d KV blocks (%.2f GiB)", utilization, total / GIB, step_bytes / GIB, NON_TORCH_BYTES / GIB,
             blocks, blocks * bytes_per_block / GIB)
    return blocks
