"""Owns the model and the KV tensors; turns a scheduler plan into one forward and samples.

One forward per step over a flattened batch: all new tokens of all scheduled sequences in
one row, decodes first, with per-token positions and cache slots. The model is the plain
`transformers` definition with the paged attention op plugged in, compiled into one graph
(``splitserve.engine.compiled_forward``) unless ``enforce_eager`` is set; on CUDA, decode steps replay
graphs captured at start-up for padded batch sizes (``splitserve.engine.cuda_graphs``). With
``tensor_parallel_size`` N > 1 the model is one rank's shard and rank 0 sends every step to the
other ranks (``splitserve.engine.tensor_parallel``), which run ``follow`` on theirs.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch

from splitserve.engine.attention import StepLayout, select_backend
from splitserve.engine.attention.kv_quant import kv_quant, row_width
from splitserve.engine.attention.page_order import page_order_for, page_shape, token_view
from splitserve.engine.attention.hf_integration import ATTN_IMPLEMENTATION, StepContext, step_context
from splitserve.engine.compiled_forward import build_forward
from splitserve.engine.host_kv_pages import HostKVPages
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_connector import KVConnector
from splitserve.engine.kv_groups import KVGroups, layer_windows, one_group, plan_groups
from splitserve.engine.kv_sizes import kv_bytes_per_token, pages_for_budget, pages_for_tokens
from splitserve.engine.cuda_graphs import DecodeGraphs, capture_sizes
from splitserve.engine.cpu_linear import pack_linear_layers, padded_rows, resolve_linear_backend, step_padding
from splitserve.engine.model_loader import load_config, load_model
from splitserve.engine.model_registry import (SUPPORTED, architecture_of, check_supported, final_logits,
                                              quantization_to_load)
from splitserve.engine.sampler import Sampler, SamplingRow
from splitserve.engine.scheduler import SampledToken, ScheduledChunk, SchedulerOutput
from splitserve.engine.rejection_sampler import verify
from splitserve.engine.rotary_cache import cache_rotary_embeddings
from splitserve.engine.step_inputs import InputBuffers, expand_verification
from splitserve.engine.step_phases import StepPhases
from splitserve.engine.tensor_parallel import TP_FOLLOWER, FollowerProgram, rank_device
from splitserve.engine.tensor_parallel.messages import StepMessage, layout_on

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:  # an explicit index: comparable, and set_device-able
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def bind_device(device: torch.device) -> None:
    """Make ``device`` the current CUDA device of the calling thread (no-op off CUDA).

    Triton kernels and CUDA graph replays launch on the *current* device, not on their tensors'
    one, and every thread starts on cuda:0: a worker on cuda:1 stepping its engine on a thread of
    its own would run its attention on the wrong GPU. Cheap enough to call every step."""
    if device.type == "cuda" and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on GPUs and on CPUs whose oneDNN computes in bf16 natively (AVX-512 BF16, AMX);
    fp32 on other CPUs, where bf16 linear layers are emulated (8x slower than fp32 on an AVX2
    Zen 3 at 64 rows: 16 vs 130 GF/s). Correctness checks ask for fp32 explicitly."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.float32
    return torch.bfloat16


# Makes the device KV pool: (shape, dtype, device) -> tensor. The shm transport passes one
# that maps the pool into shared memory so a prefill process can write into it.
PoolFactory = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def default_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


class ModelRunner:
    """``tp_rank``: which rank of a tensor-parallel worker this is; rank 0 (the default) starts the
    others (``self.followers``) and sends them every step, a rank > 0 is driven by ``follow``."""

    def __init__(self, config: EngineConfig, model_dir: Path, pool_factory: PoolFactory = default_pool,
                 max_model_len: int | None = None, tp_rank: int = 0, tp_comm=None,
                 tp_follower: FollowerProgram = TP_FOLLOWER):
        self.config = config
        self.phases = StepPhases()  # where the steps' time goes (prepare, forward, sample here)
        self.tp_rank, self.tp_size = tp_rank, config.tensor_parallel_size
        self.device = rank_device(resolve_device(config.device), tp_rank)
        bind_device(self.device)  # the compile warm-up and the graph capture below run on this thread
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.followers = None
        # The program ranks > 0 run (``splitserve.engine.kv_connector``: a KV connector's own).
        self.tp_follower = tp_follower
        # The ranks' all-reduce (splitserve.engine.tensor_parallel.all_reduce): given to a rank > 0, made
        # with the other ranks on rank 0.
        self.tp_comm = tp_comm
        # The KV handoff's worker side on rank 0, while one is attached (``attach_kv_connector``).
        self.kv_connector: KVConnector | None = None
        hf = load_config(model_dir)
        self.max_model_len = max_model_len or config.max_model_len or getattr(hf, "max_position_embeddings", 2048)
        check_supported(hf)  # before any weight loads
        # --quantization, or the checkpoint's own format (GPTQ, AWQ, FP8, ...) when the flag is
        # unset; read from the checkpoint as shipped (a GGUF, or a quantization_config), or
        # quantized here after a float checkpoint loads (int8, fp8).
        self.quantization = quantization_to_load(hf, config.quantization)
        shipped = self.quantization == "gguf" or getattr(hf, "quantization_config", None)
        self.checkpoint_quantization = self.quantization if shipped else None
        # --quantization int8/fp8 of a float checkpoint: one rank quantizes each linear as its weight
        # is read (the float model never exists whole); under TP each rank quantizes its own shard
        # after sharding (a quantized checkpoint loads in its codes either way).
        self.quantized_weights = None
        quantize_here = bool(self.quantization) and not self.checkpoint_quantization
        if self.tp_size > 1:
            self.model = self._load_shard(model_dir)
        elif quantize_here and config.load_format != "dummy" and any(model_dir.glob("*.safetensors")):
            from splitserve.engine.quantization.checkpoint import NeedsConversion, load_quantizing
            try:
                self.model, self.quantized_weights = load_quantizing(model_dir, self.quantization, self.dtype,
                                                                     self.device, ATTN_IMPLEMENTATION)
            except NeedsConversion as exc:  # e.g. per-expert MoE tensors: transformers loads, then we quantize
                log.info("quantizing after a whole load: %s", exc)
                self.model = load_model(model_dir, self.dtype, self.device, attn_implementation=ATTN_IMPLEMENTATION)
        else:
            self.model = load_model(model_dir, self.dtype, self.device, attn_implementation=ATTN_IMPLEMENTATION,
                                    load_format=config.load_format,
                                    checkpoint_quantization=self.checkpoint_quantization)
        if quantize_here and self.quantized_weights is None:
            from splitserve.engine.quantization import quantize_model
            self.quantized_weights = quantize_model(self.model, self.quantization)
        # cos/sin of every position a step reaches, start-up's too (GPU memory profile, warm-up): rotary_cache.py.
        cache_rotary_embeddings(self.model, max(self.max_model_len, config.max_num_batched_tokens,
                                                config.max_num_seqs, config.block_size), self.dtype, self.device)
        self.linear_backend = resolve_linear_backend(config.linear_backend, self.device, self.dtype)
        if self.linear_backend != "torch":
            pack_linear_layers(self.model, self.linear_backend)
        # The decoder stack and the output projection, whatever the architecture calls them
        # (``model``/``lm_head`` in most, ``gpt_neox``/``embed_out`` in GPT-NeoX), and what its
        # head does to the logits after the projection. Taken after the packing above, which
        # replaces the projection with its packed form.
        self.decoder, self.lm_head = self.model.base_model, self.model.get_output_embeddings()
        self.final_logits = final_logits(hf)
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = (getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads) // self.tp_size
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.block_size = config.block_size
        self.backend = select_backend(config.attention_backend, self.device.type, self.head_dim)
        if self.backend.name == "triton":  # CUDA, or CPU tensors under the interpreter
            from splitserve.engine.experts import use_triton_experts
            use_triton_experts(self.model)  # mixture-of-experts layers as grouped-GEMM launches
        # Quantized pages (--kv-cache-dtype) are rows of 8-bit codes + a float32 scale; see kv_quant.
        self.kv_quant = kv_quant(config.kv_cache_dtype)
        self.kv_dtype = self.kv_quant.storage if self.kv_quant else self.dtype
        self.kv_row = row_width(self.head_dim, self.kv_quant)
        # Which layers share pages (kv_groups): windowed layers apart from full ones, so their pages
        # can go back behind the window; one group of every layer otherwise.
        self.kv_groups = self._kv_groups(hf)
        self.num_blocks = config.num_gpu_blocks or self._pool_blocks()
        if self.tp_size > 1:  # every rank holds the same page ids: the smallest pool of them all
            from splitserve.engine.tensor_parallel.ranks import all_reduce_min
            self.num_blocks = all_reduce_min(self.tp_comm.group, self.num_blocks, self.device)
        # On the CPU a page keeps each KV head's tokens together ([heads, block, row], as vLLM-CPU's
        # pages do): a decode walks one head's pages and reads them as one stream, where token-major
        # rows of a head are strided (the kernel alone: 64 x 300 tokens 25-35 % faster; a decode
        # step at 64 x 1,000: 10-20 % faster; docs/performance-history.md).
        # The Triton GPU kernels keep token-major pages (page_order_for).
        self.page_order = page_order_for(self.device.type, self.block_size, self.num_kv_heads)
        shape = page_shape(self.page_order, self.kv_groups.slots, self.num_blocks, self.block_size,
                           self.num_kv_heads, self.kv_row)
        # The pool as it lies in memory: what kvtransfer and swapping copy, whole pages at a time.
        self.kv_pages = pool_factory(shape, self.kv_dtype, self.device)
        # The same memory as [slots, 2, blocks, block_size, kv_heads, row] whatever the page order
        # (slots: the layers of one KV group, every layer unless the model mixes attention kinds):
        # what attention, checksums and tests index.
        self.kv_cache = token_view(self.kv_pages, self.page_order)
        # The host KV tier's pages (splitserve/engine/kv_offload.py), laid out as the pool's.
        self.host_kv = HostKVPages(self.kv_pages, config.kv_offloading_size) \
            if config.kv_offloading_size and not config.kv_offloading_shared else None
        # Swap preemption's host pages (with the host tier, its pages: kv_offload.SwapSlots).
        self.cpu_cache = None
        if config.preemption_mode == "swap" and self.host_kv is None:
            self.cpu_cache = torch.zeros((*shape[:2], config.num_cpu_blocks, *shape[3:]), dtype=self.kv_dtype,
                                         pin_memory=self.device.type == "cuda")
        self.kv_caches = [(self.kv_cache[slot, 0], self.kv_cache[slot, 1]) for _, slot in self.kv_groups.place]
        eos = self.model.generation_config.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.sampler = Sampler(self.eos_token_ids)
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        # Speculative decoding verifies each proposal in a row of its own (splitserve.engine.step_inputs.VerifyRow).
        max_rows = config.max_num_seqs * (1 + config.num_speculative_tokens) if config.speculative_method \
            else config.max_num_seqs
        self.inputs = InputBuffers(max_tokens, min(max_rows, max_tokens), pages_for_tokens(self.max_model_len, self.block_size),
                                   self.block_size, self.device, num_groups=len(self.kv_groups.windows),
                                   pad_tokens=step_padding(self.linear_backend, self.backend.name, self.quantization,
                                                           config.enable_lora, SUPPORTED[architecture_of(hf)].experts))
        # LoRA: every projection wrapped before the forward is compiled (splitserve/engine/lora).
        self.lora = None
        if config.enable_lora:
            from splitserve.engine.lora.manager import LoRAManager
            self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank, max_tokens, self.dtype,
                                    self.device, grouped=self.backend.name == "triton")
        self.forward = build_forward(self.decoder, config, self.device)
        if hasattr(self.forward, "warm_up"):
            self.forward.warm_up(self._dummy_forward)
        self.graphs: DecodeGraphs | None = None
        # Not with tensor parallelism yet: NCCL all-reduces inside captured graphs are untested here.
        if self.device.type == "cuda" and not config.enforce_eager and self.tp_size == 1:
            self.graphs = DecodeGraphs(self.forward, self.backend, self.kv_caches, self.inputs, self.max_model_len,
                                       capture_sizes(config.max_num_seqs))
            self.graphs.capture()
        groups = self.kv_groups
        log.info("model runner: %s on %s in %s, attention %s, linear %s, %s, %d KV blocks of %d tokens (KV %s%s)%s",
                 model_dir.name, self.device, self.dtype, self.backend.name, self.linear_backend,
                 self.forward.describe(),
                 self.num_blocks, self.block_size, config.kv_cache_dtype,
                 f"; {len(groups.windows)} groups of {groups.slots} layers, windows {groups.windows}"
                 if groups.frees_pages else "",
                 f", tensor-parallel rank {tp_rank} of {self.tp_size}" if self.tp_size > 1 else "")

    def _kv_groups(self, hf) -> KVGroups:
        windows = layer_windows(hf)
        if len(windows) != self.num_layers:
            raise ValueError(f"config.json lists {len(windows)} layer_types for {self.num_layers} layers")
        if not any(windows):
            return one_group(self.num_layers)
        c = self.config
        why_not = ("--disable-hybrid-kv-cache-manager" if c.disable_hybrid_kv_cache_manager else
                   "tensor parallelism" if self.tp_size > 1 else
                   "swap preemption" if c.preemption_mode == "swap" else
                   "the host KV tier (--kv-offloading-size)" if c.kv_offloading_size else
                   "a draft model" if c.speculative_method == "draft" else
                   "CUDA graphs (--enforce-eager frees them)" if self.device.type == "cuda" and not c.enforce_eager
                   else None)
        if why_not:
            log.info("windowed layers keep every page (no hybrid KV layout with %s)", why_not)
            return one_group(self.num_layers)
        return plan_groups(windows)

    def _load_shard(self, model_dir: Path) -> torch.nn.Module:
        """Rank 0 checks the split and starts the other ranks first (they load while it does);
        each rank loads the checkpoint on the host, keeps its shard and moves only that to its device."""
        from transformers import AutoConfig

        from splitserve.engine.tensor_parallel.shard import check_divisible, register_group, shard_model
        if self.tp_rank == 0:
            hf = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
            check_divisible(hf, self.tp_size)
            if self.config.speculative_method == "draft":
                raise ValueError("a draft model (speculative_method='draft') with tensor_parallel_size > 1 is not "
                                 "supported; use speculative_method='ngram'")
            from splitserve.engine.tensor_parallel.ranks import FollowerRanks
            self.followers = FollowerRanks(self.config, model_dir, self.device, self._all_reduce_bytes(hf),
                                           self.tp_follower)
            self.tp_comm = self.followers.all_reduce
        model = load_model(model_dir, self.dtype, "cpu", attn_implementation=ATTN_IMPLEMENTATION,
                           load_format=self.config.load_format,
                           checkpoint_quantization=self.checkpoint_quantization)
        self.tp_group_id = register_group(self.tp_comm)
        shard_model(model, self.tp_rank, self.tp_size, self.tp_group_id)
        return model.to(self.device)

    def _all_reduce_bytes(self, hf) -> int:
        """The largest all-reduce of a step: a row of hidden size per token of the largest step
        (padded as a CPU step may be fed: ``cpu_linear.step_padding``)."""
        c = self.config
        rows = max(c.max_num_batched_tokens, c.max_num_seqs * (1 + (c.num_speculative_tokens if c.speculative_method
                                                                     else 0)), c.block_size)
        return padded_rows(rows) * hf.hidden_size * torch.empty((), dtype=self.dtype).element_size()

    def configure_follower_kv(self, message) -> list:
        """``message`` to every other rank's KV connector; their replies, in rank order."""
        return self.followers.request(message) if self.followers is not None else []

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do without them)."""
        if self.followers is not None:
            self.followers.close()
        if self.tp_size > 1:
            from splitserve.engine.tensor_parallel.shard import unregister_group
            unregister_group(self.tp_group_id)

    @property
    def kv_bytes_per_token(self) -> int:
        """What one token of one page id costs: the layers of one KV group (every layer, unless
        windowed layers have groups of their own)."""
        return kv_bytes_per_token(self.kv_groups.slots, self.num_kv_heads, self.head_dim,
                                  torch.empty((), dtype=self.kv_dtype).element_size(), self.kv_quant is not None)

    def _pool_blocks(self) -> int:
        per_block = self.kv_bytes_per_token * self.block_size
        if self.config.gpu_memory_utilization is None:
            return pages_for_budget(self.config.kv_cache_memory_gb, self.kv_bytes_per_token, self.block_size)
        if self.device.type != "cuda":
            raise ValueError("gpu_memory_utilization sizes a KV pool on a GPU; this engine is on "
                             f"{self.device}: size it with kv_cache_memory_gb (or num_gpu_blocks)")
        from splitserve.engine.gpu_memory import kv_blocks_for_utilization
        return kv_blocks_for_utilization(self, self.config.gpu_memory_utilization, per_block)

    # ---- one step ------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, plan: SchedulerOutput) -> dict[str, list[SampledToken]]:
        """One step: the new tokens of each sampling request (one; with proposals, the accepted
        ones and the token sampled after them, ``splitserve.engine.rejection_sampler``)."""
        bind_device(self.device)  # the engine may be stepped by any thread (a worker's engine loop)
        if self.followers is not None and (plan.swap_out or plan.swap_in):
            self.followers.broadcast(StepMessage(swap_out=tuple(plan.swap_out), swap_in=tuple(plan.swap_in)))
        self._swap(plan.swap_out, plan.swap_in)
        if plan.is_empty:
            return {}
        self.phases.steps += 1
        logits, chunks = self.logits(plan)
        if not chunks:
            return {}
        with self.phases.timing("sample"):
            if any(c.spec_token_ids for c in chunks):
                return verify(self.sampler, logits, chunks)
            requests = [chunk.request for chunk in chunks]
            rows = [SamplingRow.of(r) for r in requests]
            out = self.sampler(logits, rows)
            logprobs = out.logprobs or [None] * len(requests)
            return {r.request_id: [SampledToken(t, lp)] for r, t, lp in zip(requests, out.token_ids, logprobs)}

    @torch.inference_mode()
    def logits(self, plan: SchedulerOutput, feed: Callable[[torch.Tensor], None] | None = None
               ) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """The forward of ``plan``'s tokens (their K/V land in the pool): the logits of the sampled
        rows ([rows, vocab]: one per sampling chunk, 1 + P for one with P proposals) and those chunks.
        ``feed``: writes the tokens a step in flight samples into the step's input ids, on the
        device (async scheduling, ``splitserve.engine.async_scheduling``)."""
        bind_device(self.device)
        kv = self.kv_connector
        num_seqs = len(plan.chunks)
        graph_size = None
        with self.phases.timing("prepare"):
            if self.graphs is not None and kv is None and all(c.is_decode for c in plan.chunks):
                graph_size = self.graphs.padded_size(num_seqs)
            step = self.inputs.build(plan.chunks, plan.block_tables, pad_to=graph_size,
                                     group_block_tables=plan.group_block_tables)
            if feed is not None:
                feed(step.input_ids)
            if self.lora is not None:
                self.lora.prepare_step(expand_verification(plan.chunks), step.layout.query_start_list)
            message = None
            if self.followers is not None:
                # Host copies: a device tensor sent as it is would come back on rank 0's device.
                message = StepMessage(input_ids=step.input_ids.to("cpu", copy=True),
                                      positions=step.positions.to("cpu", copy=True),
                                      layout=layout_on(step.layout, "cpu", copy=True),
                                      kv_orders=kv.step_orders(plan) if kv is not None else ())
                self.followers.broadcast(message)
        with self.phases.timing("forward"):
            if graph_size is not None:
                hidden = self.graphs.replay(num_seqs, graph_size)
            else:
                hidden = self._forward(step.layout, step.input_ids, step.positions,
                                       (lambda layer: kv.save_layer(plan, layer)) if kv is not None else None,
                                       step.group_layouts)
            if message is not None and message.wants_reply:
                failures: dict[str, str] = {}
                for reply in self.followers.gather():
                    failures.update(reply)
                kv.followers_failed(failures)
            if not step.sample_chunks:
                return hidden[:0], []
            return self.head(hidden[step.sample_index]), step.sample_chunks

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of ``hidden`` rows, as the model's own head computes them."""
        logits = self.lm_head(hidden)
        return logits if self.final_logits is None else self.final_logits(logits)

    def _forward(self, layout: StepLayout, input_ids: torch.Tensor, positions: torch.Tensor,
                 on_layer: Callable[[int], None] | None, group_layouts: tuple[StepLayout, ...] = ()) -> torch.Tensor:
        with step_context(self._step_context(layout, group_layouts, on_layer)):
            return self.forward(input_ids, positions)

    def _step_context(self, layout: StepLayout, group_layouts: tuple[StepLayout, ...] = (),
                      on_layer: Callable[[int], None] | None = None) -> StepContext:
        """The context the attention op reads; ``group_layouts``: the further KV groups' layouts
        (every group gets ``layout`` where there are none, as the warm-up's one page of each)."""
        prepared = self.backend.prepare(layout)
        ctx = StepContext(self.backend, layout, prepared, self.kv_caches, on_layer_written=on_layer)
        groups = self.kv_groups
        if len(groups.windows) > 1:
            others = [(g, self.backend.prepare(g)) for g in group_layouts] or \
                [(layout, prepared)] * (len(groups.windows) - 1)
            ctx.group_steps = ((layout, prepared), *others)
        if groups.frees_pages:
            ctx.group_windows = groups.windows
            ctx.layer_group = tuple(g for g, _ in groups.place)
        return ctx

    @torch.inference_mode()
    def follow(self, message: StepMessage, on_layer: Callable[[int], None] | None = None) -> None:
        """Rank r > 0: the swaps and the forward rank 0 runs this step, on this rank's shard."""
        bind_device(self.device)
        self._swap(message.swap_out, message.swap_in)
        if message.input_ids is None:
            return
        n = message.input_ids.shape[0]
        ids, pos = self.inputs.device_tensors[:2]  # the persistent buffers, as rank 0's compiled graph sees them
        ids[:n].copy_(message.input_ids)
        pos[:n].copy_(message.positions)
        self._forward(layout_on(message.layout, self.device), ids[:n], pos[:n], on_layer)

    @torch.inference_mode()
    def _dummy_forward(self) -> None:
        """One prefill of a block's worth of tokens into page 0, which no request holds yet
        (the runner is built before the cache manager hands out pages)."""
        n = self.block_size
        dev = self.device
        layout = StepLayout(slot_mapping=torch.arange(n, device=dev),
                            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
                            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
                            block_tables=torch.zeros((1, 1), dtype=torch.int32, device=dev),
                            num_decodes=0, query_lens_list=[n], seq_lens_list=[n], block_size=n)
        # As a real step runs: slices of the persistent input buffers, the forward under inference
        # mode. Fresh tensors fail a guard of the compiled graph (their dispatch keys differ) and
        # the first request would compile it again (~9 s for SmolLM2).
        ids, pos = self.inputs.device_tensors[:2]
        with torch.inference_mode(), step_context(self._step_context(layout)):
            ids[:n].zero_()
            pos[:n].copy_(torch.arange(n, device=dev))
            self.forward(ids[:n], pos[:n])
        self.kv_cache[:, :, 0].zero_()

    def _swap(self, swap_out, swap_in) -> None:
        # Out before in: a block swapped out this step may be the target of a swap-in.
        if swap_out:
            src, dst = zip(*swap_out)
            self.cpu_cache[:, :, list(dst)] = self.kv_pages[:, :, list(src)].to("cpu")
        if swap_in:
            src, dst = zip(*swap_in)
            self.kv_pages[:, :, list(dst)] = self.cpu_cache[:, :, list(src)].to(self.device)
