"""Engine configuration: one frozen dataclass, validated once, named as vLLM names its knobs."""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")
BATCHING_MODES = ("continuous", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# KV page formats, vLLM's names: "auto" is the model dtype; fp8 is fp8_e4m3 (splitserve/engine/attention/kv_quant.py).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
# Bytes of the float32 scale that ends each quantized (token, head) row of 8-bit codes.
KV_SCALE_BYTES = 4
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
# Linear layers: "onednn" (prepacked weights, fp32 on CPU; splitserve/engine/cpu_linear.py) or "torch".
LINEAR_BACKENDS = ("auto", "onednn", "onednn-matmul", "torch")
LOAD_FORMATS = ("auto", "dummy")
ASYNC_SCHEDULING = ("auto", "on", "off")
# Speculative decoding (splitserve/engine/spec_decode): prompt lookup, or a small draft model.
SPECULATIVE_METHODS = ("ngram", "draft")
# Weight quantization (splitserve/engine/quantization/), and vLLM's names for what this engine
# does not do yet: those are refused as such, not as a typo. The checkpoint formats are read as
# shipped; int8, and fp8 given a float checkpoint, quantize it at load.
CHECKPOINT_QUANTIZATIONS = ("gguf", "gptq", "awq", "fp8", "compressed-tensors")
QUANTIZATION_METHODS = ("int8", *CHECKPOINT_QUANTIZATIONS)
QUANTIZATION_NOT_YET = ("awq_marlin", "gptq_marlin", "bitsandbytes",
                        "experts_int8", "fbgemm_fp8", "marlin", "modelopt", "mxfp4", "torchao")


def check_quantization(method: str | None) -> None:
    """A clear error for a quantization method this engine does not serve."""
    if not method or method in QUANTIZATION_METHODS:
        return
    if method in QUANTIZATION_NOT_YET:
        raise ValueError(f"quantization={method!r} is not implemented by this engine yet (it serves: "
                         f"{', '.join(QUANTIZATION_METHODS)}; or leave it unset for the checkpoint's own weights)")
    raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} (or unset), got {method!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the scheduler, cache manager and runner need to agree on."""

    # Model alias (smollm2-135m-instruct) or local Hugging Face checkpoint directory.
    model: str = "smollm2-135m-instruct"
    # Tokens per KV page.
    block_size: int = 16
    # Upper bound on sequences in one step (prefills and decodes together).
    max_num_seqs: int = 64
    # Token budget of one step, shared by prefill chunks and decodes.
    max_num_batched_tokens: int = 2048
    # Longest prompt + output a request may have; None takes the model's own limit.
    max_model_len: int | None = None
    # Pages in the device KV pool; None sizes it from kv_cache_memory_gb.
    num_gpu_blocks: int | None = None
    # Memory of the device KV pool, when num_gpu_blocks is not given.
    kv_cache_memory_gb: float = 1.0
    # CUDA: the share of the GPU's memory this engine may hold (weights, a step, the KV pool, which
    # gets the rest), as vLLM's knob of the same name; overrides kv_cache_memory_gb. Two processes
    # sharing one GPU (prefill + decode) split it, e.g. 0.3 + 0.6. None: kv_cache_memory_gb sizes the pool.
    gpu_memory_utilization: float | None = None
    # Pages in the host pool that swap preemption moves sequences into.
    num_cpu_blocks: int = 256
    # Reuse the KV of full prompt blocks seen before (hash of the block chain).
    enable_prefix_caching: bool = True
    # GiB of host memory for the KV tier below the pool (vLLM's --kv-offloading-size): prefix pages
    # the pool evicts are kept there and brought back for a later hit (splitserve/engine/kv_offload.py).
    # 0: off. Needs prefix caching; windowed models keep every page in the pool with it.
    kv_offloading_size: float = 0.0
    # GiB of disk below the host KV tier: pages it lets go are written there (a file each, with a
    # CRC32 checked when read back) and a later hit reads them back. 0: off. Needs kv_offloading_size.
    kv_offloading_disk_size: float = 0.0
    # Where the disk tier keeps its files: a fresh directory of each engine's own under it, removed
    # when the engine closes or its process exits. "": the system's temporary directory.
    kv_offloading_dir: str = ""
    # Bring the KV tiers' prefix hits back on a thread of their own while steps go on for others,
    # the request waiting meanwhile (splitserve/engine/prefix_loads.py); else in its admission,
    # the step waiting for the copies.
    kv_offloading_overlap: bool = True
    # The host KV tier in shared memory, one for every worker of this host serving the same model
    # with the same KV layout: each loads what the others stored (splitserve/engine/shared_kv_tier.py).
    # The first worker sizes it (kv_offloading_size); no disk tier below it, no swap into it.
    kv_offloading_shared: bool = False
    # Chunk prompts longer than the step budget instead of refusing them.
    enable_chunked_prefill: bool = True
    # Order of waiting requests: "priority" (lower value first, aged by priority_aging_per_s;
    # with equal priorities it is arrival order) or "fcfs" (arrival only, priorities ignored).
    scheduling_policy: str = "priority"
    # Priority points a waiting request gains per second of waiting (priority policy only),
    # so a low-priority request cannot starve under a steady high-priority stream.
    priority_aging_per_s: float = 1.0
    # When pages run out: "recompute" (drop the victim's pages, prefill again later) or "swap"
    # (move them to the host pool and back).
    preemption_mode: str = "recompute"
    # "continuous" (requests join and leave every step) or "static" (the baseline: fixed
    # batches run to their longest member).
    batching: str = "continuous"
    # Batch size of the static baseline.
    static_batch_size: int = 8
    # Weights and KV dtype; "auto" is bfloat16.
    dtype: str = "auto"
    # KV pages: "auto" (the model dtype) or 8-bit codes with a float32 scale per token and head:
    # "int8", "fp8"/"fp8_e4m3", "fp8_e5m2" (about half the bytes of bf16: ~1.9x the pages per GB).
    kv_cache_dtype: str = "auto"
    # "auto" (CUDA when present), "cpu", "cuda", "cuda:N".
    device: str = "auto"
    # Ranks (processes) one worker shards the model over (vLLM's name): attention heads, KV heads
    # and MLP columns split across them, one scheduler on rank 0 (splitserve/engine/tensor_parallel). On a GPU
    # rank r runs on the device after ``device`` by r (cuda:N+r); on a CPU each rank is a process.
    tensor_parallel_size: int = 1
    # Paged attention kernels: "auto" (triton on CUDA, torch on CPU), "torch" or "triton".
    attention_backend: str = "auto"
    # Linear layers: "auto" (prepacked oneDNN weights on a CPU that computes the dtype natively: its
    # matmul primitive for fp32/bf16, its inner product for fp16; torch elsewhere), "onednn-matmul",
    # "onednn" (torch's inner product), "torch".
    linear_backend: str = "auto"
    # Run the model op by op instead of as one compiled graph (vLLM's escape hatch of the same name).
    enforce_eager: bool = False
    # Plan and prepare each step while the device runs the one before (vLLM's async scheduling,
    # splitserve/engine/async_scheduling.py): "auto" on CUDA, "on" (an error where a feature rules
    # it out), "off". On a CPU the step runs as it is queued, so "on" gains nothing there.
    async_scheduling: str = "auto"
    # Keep every page of windowed layers (Gemma 2/3, gpt-oss, Mistral) instead of giving back those
    # behind the window (kv_groups, vLLM's hybrid KV cache manager). Disaggregated workers always do.
    disable_hybrid_kv_cache_manager: bool = False
    # Weights: auto, the checkpoint's; dummy, random ones built from config.json alone (vLLM's
    # name), to measure or check a model's shapes without its checkpoint (tokens are meaningless).
    load_format: str = "auto"
    # Quantized weights (vLLM's flag). Quantized at load: "int8" or "fp8" (e4m3), weight-only, one
    # scale per output channel (a quarter of fp32's weight bytes; decode reads fewer). Read as
    # shipped: "gguf" (the model directory's .gguf file, its Q4_0/Q4_1/Q8_0 tensors kept in their
    # codes), "gptq", "awq", "fp8" and "compressed-tensors" (found in config.json's
    # quantization_config when unset). Unset: the checkpoint's own weights.
    quantization: str | None = None
    # Colocated workers: size each step's share of prompt tokens (the chunked-prefill size) so that
    # steps with decodes take about this many ms while prompts arrive (splitserve/engine/step_budget.py);
    # None: every step may fill max_num_batched_tokens.
    target_tpot_ms: float | None = None
    # Engine seed (vLLM's name; requests are seeded by SamplingParams.seed, this is not read yet).
    seed: int = 0
    # Speculative decoding (vLLM's names): "ngram" (prompt lookup: the tokens that followed the
    # sequence's last n-gram earlier in it) or "draft" (a small model, speculative_model); unset: off.
    speculative_method: str | None = None
    # Tokens proposed per decoding sequence and step; the model verifies them in one forward.
    num_speculative_tokens: int = 3
    # ngram: the longest suffix n-gram looked up (longer ones first).
    prompt_lookup_max: int = 4
    # ngram: the shortest suffix n-gram looked up.
    prompt_lookup_min: int = 2
    # draft: the draft model (alias or checkpoint directory) with the target's vocabulary.
    speculative_model: str | None = None
    # Structured output: MB of compiled grammars kept for reuse (least recently used go first); a
    # compiled grammar takes from kilobytes to megabytes (its token masks), and each distinct
    # schema, regex or choice list is one.
    grammar_cache_mb: int = 256
    # Structured output: seconds a request's grammar may take to compile on a worker (off the
    # engine thread) before the request is refused.
    grammar_compile_timeout_s: float = 10.0
    # LoRA (vLLM's names): serve adapters of this model beside it, requests naming theirs; every
    # projection gets the stacked adapter matrices (splitserve/engine/lora).
    enable_lora: bool = False
    # Adapters resident at once (slots; least recently used out first). The cost of a step grows
    # with max_loras * max_lora_rank, whatever adapters it holds.
    max_loras: int = 1
    # The highest adapter rank accepted (a higher one is refused when it is added).
    max_lora_rank: int = 16

    def async_scheduling_blocker(self) -> str | None:
        """What in this configuration rules async scheduling out (splitserve/engine/async_scheduling.py)."""
        return ("speculative decoding" if self.speculative_method else
                "static batching" if self.batching == "static" else
                "tensor parallelism" if self.tensor_parallel_size > 1 else
                "LoRA" if self.enable_lora else
                "target_tpot_ms (its step budget learns from synchronous steps)" if self.target_tpot_ms else None)

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        def one_of(name: str, allowed: tuple[str, ...]) -> None:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "static_batch_size",
                     "tensor_parallel_size", "grammar_cache_mb", "max_loras", "max_lora_rank"):
            positive(name)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_gpu_blocks is not None:
            positive("num_gpu_blocks")
        if self.max_model_len is not None:
            positive("max_model_len")
        if self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.target_tpot_ms is not None and not self.target_tpot_ms > 0:
            raise ValueError(f"target_tpot_ms must be > 0, got {self.target_tpot_ms}")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        if self.priority_aging_per_s < 0:
            raise ValueError(f"priority_aging_per_s must be >= 0, got {self.priority_aging_per_s}")
        one_of("scheduling_policy", SCHEDULING_POLICIES)
        one_of("preemption_mode", PREEMPTION_MODES)
        one_of("batching", BATCHING_MODES)
        one_of("dtype", DTYPES)
        one_of("kv_cache_dtype", KV_CACHE_DTYPES)
        one_of("attention_backend", ATTENTION_BACKENDS)
        one_of("linear_backend", LINEAR_BACKENDS)
        one_of("load_format", LOAD_FORMATS)
        one_of("async_scheduling", ASYNC_SCHEDULING)
        if self.async_scheduling == "on" and self.async_scheduling_blocker():
            raise ValueError(f"async_scheduling='on' does not go with {self.async_scheduling_blocker()}")
        check_quantization(self.quantization)
        self._check_speculative(positive)
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora with tensor_parallel_size > 1 is not supported yet")
        if self.kv_offloading_size < 0:
            raise ValueError(f"kv_offloading_size must be >= 0 GiB, got {self.kv_offloading_size}")
        if self.kv_offloading_disk_size < 0:
            raise ValueError(f"kv_offloading_disk_size must be >= 0 GiB, got {self.kv_offloading_disk_size}")
        if self.kv_offloading_disk_size and not self.kv_offloading_size:
            raise ValueError("kv_offloading_disk_size needs kv_offloading_size: the disk tier takes what the host "
                             "tier lets go")
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size needs prefix caching: the host tier keeps evicted prefix pages")
        if self.kv_offloading_shared and not self.kv_offloading_size:
            raise ValueError("kv_offloading_shared needs kv_offloading_size: the size of the shared tier")
        if self.kv_offloading_shared and self.kv_offloading_disk_size:
            raise ValueError("kv_offloading_disk_size with kv_offloading_shared is not supported yet")
        if self.kv_offloading_shared and self.preemption_mode == "swap":
            raise ValueError("preemption_mode='swap' with kv_offloading_shared is not supported yet (recompute is)")
        if self.kv_offloading_size and self.tensor_parallel_size > 1:
            raise ValueError("kv_offloading_size with tensor_parallel_size > 1 is not supported yet")
        if self.preemption_mode == "swap" and self.num_cpu_blocks == 0:
            raise ValueError("preemption_mode='swap' needs num_cpu_blocks > 0")
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_model_len > self.max_num_batched_tokens:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len}); raise it or enable chunked prefill")

    def _check_speculative(self, positive) -> None:
        if not self.speculative_method:  # None or "" (an empty SPLITSERVE_SPECULATIVE_METHOD): off
            return
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {SPECULATIVE_METHODS} (or unset), "
                             f"got {self.speculative_method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            positive(name)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if (self.speculative_method == "draft") != bool(self.speculative_model):
            raise ValueError("speculative_model (the draft model) is needed with speculative_method='draft' "
                             "and only with it")
        if self.batching == "static":
            raise ValueError("speculative decoding needs batching='continuous'")
