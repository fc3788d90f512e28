"""The measurements ``bench.gpu_check`` runs on a GPU, each a function returning a JSON-able dict.

The model is SmolLM2-135M's shape (30 layers, 9 query / 3 KV heads of 64, vocab 49,152) with
random weights: its 98 MB of real weights cannot travel to the GPU machine, speed does not depend
on the values, and exactness compares the engine against `transformers` on the same weights.
"""
from __future__ import annotations

import copy
import json
import shutil
import time
from pathlib import Path

import torch

SMOLLM2 = {  # config.json of SmolLM2-135M-Instruct, used when the carried copy is not there
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_theta": 100000.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "hidden_act": "silu"}


def build_model(out: Path, carried: Path, seed: int = 0, device: str = "cuda") -> Path:
    """A SmolLM2-shaped checkpoint with random weights (fp32) and SmolLM2's tokenizer when carried."""
    from transformers import LlamaConfig, LlamaForCausalLM
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((carried / "config.json").read_text()) if (carried / "config.json").exists() else SMOLLM2
    config = {k: v for k, v in config.items() if k not in ("quantization_config", "transformers_version")}
    torch.manual_seed(seed)
    with torch.device(device):  # initialising 135M parameters on the CPU takes longer than the GPU work
        model = LlamaForCausalLM(LlamaConfig(**config))
    model.save_pretrained(out)
    if (carried / "tokenizer.json").exists():
        for f in carried.iterdir():
            if f.name != "config.json":
                shutil.copy2(f, out / f.name)
    else:  # no carried tokenizer: the tests' byte-level one (ids < 259 of the 49,152)
        from tests.harness.tiny_models import byte_tokenizer
        byte_tokenizer().save_pretrained(out)
    return out


def prompts(n: int, seed: int = 0, lo: int = 8, hi: int = 200) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=gen).tolist()
    return [torch.randint(3, 49152, (k,), generator=gen).tolist() for k in lengths]


def engine_exact(model_dir: Path, num_prompts: int = 12, max_tokens: int = 16, device: str = "cuda",
                 tensor_parallel_size: int | None = None) -> dict:
    """Greedy output of the engine on CUDA (fp32, Triton attention, compiled step, CUDA graphs for
    decode) against `transformers` generate on the same GPU and weights, token for token.
    ``tensor_parallel_size``: passed to the engine when given (None: the engine's default)."""
    from transformers import AutoModelForCausalLM

    from splitserve.engine import LLM, SamplingParams
    batch = prompts(num_prompts, seed=1)
    start = time.perf_counter()
    tp = {} if tensor_parallel_size is None else {"tensor_parallel_size": tensor_parallel_size}
    llm = LLM(model=str(model_dir), device=device, dtype="float32", enforce_eager=device != "cuda", max_num_seqs=16,
              num_gpu_blocks=1024, block_size=16, **tp)
    engine_tp = llm.engine.config.tensor_parallel_size  # what the engine runs with, as recorded
    startup_s = time.perf_counter() - start
    runner = llm.engine.runner
    replays: list[int] = []
    if runner.graphs is not None:
        original = runner.graphs.replay
        runner.graphs.replay = lambda n, size: replays.append(n) or original(n, size)
    outputs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    got = [o.token_ids for o in outputs]
    del llm, runner
    torch.cuda.empty_cache()

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    config = copy.deepcopy(hf.generation_config)
    config.eos_token_id = hf.config.vocab_size  # never stops early, as ignore_eos
    config.pad_token_id = 0
    mismatches = []
    for i, (prompt, tokens) in enumerate(zip(batch, got)):
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                              max_new_tokens=max_tokens, do_sample=False, output_scores=True,
                              return_dict_in_generate=True)
        expected = out.sequences[0, len(prompt):].tolist()
        if tokens != expected:
            at = next(k for k, (a, b) in enumerate(zip(tokens, expected)) if a != b)
            top2 = out.scores[at][0].float().topk(2).values.tolist()
            mismatches.append({"prompt": i, "position": at, "engine": tokens[at], "transformers": expected[at],
                               "transformers_top2_margin": top2[0] - top2[1]})
    del hf
    torch.cuda.empty_cache()
    return {"ok": not mismatches and (device != "cuda" or bool(replays)), "prompts": num_prompts, "max_tokens": max_tokens, "mismatches": mismatches,
            "graph_replays": len(replays), "startup_s": startup_s, "tensor_parallel_size": engine_tp,
            "note": "a mismatch with a margin near 0 is a near-tie of random weights, not necessarily a bug"}


def _cuda_time(fn, iters: int) -> float:
    """Seconds per call, CUDA events around ``iters`` calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def triton_decode_bandwidth(cases=((64, 2048), (256, 1024), (4, 8192)), iters: int = 50) -> dict:
    """KV bytes/s the Triton decode kernels read (SmolLM2 heads, bf16, pages in random order),
    against a device-to-device copy of the same number of bytes (interleaved, medians of 3)."""
    from splitserve.engine.attention import triton_decode
    from splitserve.engine.attention.triton_backend import TritonAttentionBackend
    backend = TritonAttentionBackend()
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    rows = []
    for batch, context in cases:
        pages_per_seq = context // block
        num_blocks = batch * pages_per_seq
        k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, device="cuda").to(torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(num_blocks, device="cuda").view(batch, pages_per_seq).to(torch.int32)
        query = torch.randn(batch, heads, head_dim, device="cuda").to(torch.bfloat16)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        splits = triton_decode.num_splits_for(batch, kv_heads, context, backend._programs_to_fill(query.device))
        def kernel():
            triton_decode.paged_decode(query, k_cache, v_cache, tables, qsl, lens, 0.125, splits)
        kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
        a, b = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda"), torch.empty(kv_bytes, dtype=torch.uint8,
                                                                                      device="cuda")
        kernel_s, copy_s = [], []
        for _ in range(3):
            kernel_s.append(_cuda_time(kernel, iters))
            copy_s.append(_cuda_time(lambda: b.copy_(a), iters))
        k, c = sorted(kernel_s)[1], sorted(copy_s)[1]
        rows.append({"batch": batch, "context": context, "splits": splits, "kv_bytes": kv_bytes,
                     "kernel_us": 1e6 * k, "kernel_kv_gbps": kv_bytes / k / 1e9,
                     "copy_gbps": kv_bytes / c / 1e9, "fraction_of_copy": c / k})
        del k_cache, v_cache, a, b
    return {"cases": rows, "note": "the kernel reads kv_bytes; the copy reads and writes kv_bytes"}


def triton_prefill_attention(cases=((0, 4096), (2048, 2048)), iters: int = 10) -> dict:
    """TFLOP/s of the Triton prefill kernel over paged KV on Llama-3.1-8B's attention shape (32
    query / 8 KV heads of 128, bf16, pages in random order): one sequence of ``new`` tokens after a
    cached prefix of ``cached`` (chunked prefill), causal. FLOPs: 4 x heads x head_dim x the
    (query, key) pairs the causal mask keeps; against a bf16 matmul's rate on the same GPU."""
    from bench.roofline import matmul_rate
    from splitserve.engine.attention import triton_kernels
    heads, kv_heads, head_dim, block = 32, 8, 128, 16
    rate = matmul_rate(torch.device("cuda"), torch.bfloat16, 8192)
    rows = []
    for cached, new in cases:
        context = cached + new
        num_blocks = -(-context // block)
        k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, device="cuda").to(torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(num_blocks, device="cuda").view(1, num_blocks).to(torch.int32)
        query = torch.randn(new, heads, head_dim, device="cuda").to(torch.bfloat16)
        qsl = torch.tensor([0, new], dtype=torch.int32, device="cuda")
        lens = torch.tensor([context], dtype=torch.int32, device="cuda")
        def kernel():
            triton_kernels.paged_attention(query, k_cache, v_cache, tables, qsl, lens, head_dim ** -0.5, max_q_len=new)
        seconds = _cuda_time(kernel, iters)
        pairs = new * cached + new * (new + 1) // 2
        flops = 4 * heads * head_dim * pairs
        rows.append({"cached_tokens": cached, "new_tokens": new, "kernel_ms": 1000 * seconds,
                     "tflops": flops / seconds / 1e12, "fraction_of_matmul": flops / seconds / rate})
        del k_cache, v_cache
    return {"ok": bool(rows), "cases": rows, "matmul_tflops": rate / 1e12}


def decode_throughput(model_dir: Path, batches=(1, 16, 64, 256), context: int = 512, steps: int = 10,
                      mode: str = "compiled") -> dict:
    """Decode tokens/s of the engine (bf16, compiled step, CUDA graphs) at each batch size, every
    sequence holding ``context`` tokens of KV (bench.step_time's cells): with each step waited for
    (``step_ms``) and with async scheduling (``async_step_ms``: the next step launched before the
    tokens of the one before are read), the two engines' cells interleaved."""
    from bench.step_time import build, measure
    llms = {m: build(str(model_dir), "bfloat16", m, list(batches), [context]) for m in (mode, f"{mode}+async")}
    rows = []
    for batch in batches:
        row = {"batch": batch, "context": context}
        for m, prefix in ((mode, ""), (f"{mode}+async", "async_")):
            step_s, phases = measure(llms[m][0], batch, context, steps)
            row.update({f"{prefix}step_ms": 1000 * step_s, f"{prefix}tokens_per_s": batch / step_s,
                        f"{prefix}phases_ms": phases})
        rows.append(row)
    llm, startup_s = llms[mode]
    graphs = llm.engine.runner.graphs
    overlapped = llms[f"{mode}+async"][0].engine.overlap.num_overlapped
    result = {"ok": bool(rows) and overlapped > 0, "rows": rows, "mode": mode, "startup_s": startup_s,
              "compile_s": llm.engine.runner.forward.warmup_s, "async_steps_overlapped": overlapped,
              "graph_capture_s": graphs.capture_s if graphs else None, "graph_sizes": graphs.sizes if graphs else None}
    del llm, llms
    torch.cuda.empty_cache()
    return result
