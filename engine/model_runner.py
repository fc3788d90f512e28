"""Owns the model and the KV tensors; turns a scheduler plan into one forward and samples.

One forward per step over a flattened batch: all new tokens of all scheduled sequences in
one row, decodes first, with per-token positions and cache slots. The model is the plain
`transformers` definition with the paged attention function plugged in.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch

from engine.attention import StepLayout, select_backend
from engine.attention.hf_integration import ATTN_IMPLEMENTATION, PagedForward
from engine.config import EngineConfig
from engine.model_loader import load_model
from engine.sampler import Sampler, SamplingRow
from engine.scheduler import SampledToken, SchedulerOutput

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    # bf16 serves faster than fp32 on both AVX-512/AMX CPUs and GPUs; correctness checks ask for fp32.
    return torch.bfloat16 if name == "auto" else _DTYPES[name]


# Makes the device KV pool: (shape, dtype, device) -> tensor. The shm transport passes one
# that maps the pool into shared memory so a prefill process can write into it.
PoolFactory = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def default_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, pool_factory: PoolFactory = default_pool):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype)
        self.model = load_model(model_dir, self.dtype, self.device, attn_implementation=ATTN_IMPLEMENTATION)
        hf = self.model.config
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.block_size = config.block_size
        self.backend = select_backend(config.attention_backend, self.device.type)
        self.num_blocks = config.num_gpu_blocks or self._blocks_for(config.kv_cache_memory_gb)
        shape = (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = pool_factory(shape, self.dtype, self.device)
        self.cpu_cache = None
        if config.preemption_mode == "swap":
            self.cpu_cache = torch.zeros((*shape[:2], config.num_cpu_blocks, *shape[3:]), dtype=self.dtype,
                                         pin_memory=self.device.type == "cuda")
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(self.num_layers)]
        eos = self.model.generation_config.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.sampler = Sampler(self.eos_token_ids)
        # Called as (plan, layer) once a layer's K/V of the step are in the pool: the prefill
        # side of kvtransfer ships each layer while the next one computes.
        self.layer_hook: Callable[[SchedulerOutput, int], None] | None = None
        log.info("model runner: %s on %s in %s, attention %s, %d KV blocks of %d tokens",
                 model_dir.name, self.device, self.dtype, self.backend.name, self.num_blocks, self.block_size)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_cache.element_size()

    def _blocks_for(self, gigabytes: float) -> int:
        per_block = 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.block_size \
            * torch.empty((), dtype=self.dtype).element_size()
        return max(1, int(gigabytes * 2**30) // per_block)

    # ---- one step ------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, plan: SchedulerOutput) -> dict[str, SampledToken]:
        self._swap(plan)
        if plan.is_empty:
            return {}
        input_ids, layout, sample_rows = self._build_inputs(plan)
        positions = torch.tensor(self._positions(plan), dtype=torch.int64)
        hook = self.layer_hook
        step = PagedForward(self.backend, layout, self.backend.prepare(layout), self.kv_caches,
                            on_layer_written=(lambda layer: hook(plan, layer)) if hook else None)
        hidden = self.model.model(input_ids=input_ids.to(self.device)[None],
                                  position_ids=positions.to(self.device)[None],
                                  use_cache=False, splitserve=step).last_hidden_state[0]
        if not sample_rows:
            return {}
        index = torch.tensor([i for i, _ in sample_rows], device=self.device)
        logits = self.model.lm_head(hidden[index])
        requests = [chunk.request for _, chunk in sample_rows]
        rows = [SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids, r.generator)
                for r in requests]
        out = self.sampler(logits, rows)
        logprobs = out.logprobs or [None] * len(requests)
        return {r.request_id: SampledToken(t, lp) for r, t, lp in zip(requests, out.token_ids, logprobs)}

    @staticmethod
    def _positions(plan: SchedulerOutput) -> list[int]:
        positions: list[int] = []
        for chunk in plan.chunks:
            positions.extend(range(chunk.start, chunk.start + chunk.num_tokens))
        return positions

    def _build_inputs(self, plan: SchedulerOutput):
        bs = self.block_size
        token_ids: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows = []
        for chunk in plan.chunks:
            request = chunk.request
            table = plan.block_tables[request.request_id]
            end = chunk.start + chunk.num_tokens
            if chunk.padding:  # static batching: keep the row busy with its last token
                token_ids.append(request.all_token_ids[-1])
            else:
                token_ids.extend(request.all_token_ids[chunk.start:end])
            slots.extend(table[p // bs] * bs + p % bs for p in range(chunk.start, end))
            query_start.append(query_start[-1] + chunk.num_tokens)
            seq_lens.append(end)
            tables.append(table)
            if chunk.samples:
                sample_rows.append((query_start[-1] - 1, chunk))
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        layout = StepLayout(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            num_decodes=sum(1 for c in plan.chunks if c.is_decode),
            query_lens_list=[c.num_tokens for c in plan.chunks],
            seq_lens_list=seq_lens,
            block_size=bs,
        )
        return torch.tensor(token_ids, dtype=torch.int64), layout, sample_rows

    def _swap(self, plan: SchedulerOutput) -> None:
        # Out before in: a block swapped out this step may be the target of a swap-in.
        if plan.swap_out:
            src, dst = zip(*plan.swap_out)
            self.cpu_cache[:, :, list(dst)] = self.kv_cache[:, :, list(src)].to("cpu")
        if plan.swap_in:
            src, dst = zip(*plan.swap_in)
            self.kv_cache[:, :, list(dst)] = self.cpu_cache[:, :, list(src)].to(self.device)
