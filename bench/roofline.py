"""The engine on a real model shape against what the hardware allows (issue 37, point 1).

In one run, on one device: the copy bandwidth and the bf16 matmul rate this device reaches, then
the engine's decode step time at each (batch, context) and its prefill rate at each prompt
length, each as a fraction of its roofline:

* decode: a step must read every weight once and every sequence's KV once; at the measured copy
  bandwidth that takes (weight bytes + KV bytes) / bandwidth. fraction = that / step time.
* prefill: 2 x (the layers' parameters) x tokens floating-point operations, plus the output
  projection for the last token (attention's own excluded, as the issue's aim states it);
  fraction = that / matmul rate / prefill time.

The model is built from its config alone with random weights on the device
(``load_format="dummy"``): no checkpoint travels, and speed does not depend on the values. Cells
whose KV does not fit beside the weights are reported as skipped, with the bytes they needed.

    python -m bench.roofline --shape llama-3.1-8b --out bench/results/roofline.json     # on a GPU
    python -m bench.roofline --shape tiny --dtype float32 --batches 1,2 --contexts 32,64 \\
        --prefill 32,64 --out /tmp/roofline.json                                        # rehearsal on CPU
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.common import median, write_json

SHAPES = {
    # Llama-3.1-8B's config.json (rope scaling left out: it changes no shape or cost).
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1,
        "eos_token_id": 2},
    # A shape small enough to rehearse the whole run on a CPU in seconds.
    "tiny": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2},
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, iters: int) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    fn()
    _sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return median(times)


def copy_bandwidth(device: torch.device, mib: int, iters: int = 10) -> float:
    """Bytes per second a device-to-device copy moves (read + written), the decode roofline's rate."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * src.numel() / _time(lambda: dst.copy_(src), device, iters)


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, iters: int = 10) -> float:
    """Floating-point operations per second of an n x n x n matmul in ``dtype``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n ** 3 / _time(lambda: a @ b, device, iters)


def layer_parameters(config: dict) -> int:
    """Weights every token multiplies through: each layer's projections."""
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o and k, v
    mlp = 3 * hidden * inter  # gate, up, down
    return layers * (attention + mlp)


def head_parameters(config: dict) -> int:
    """The output projection's weights: read by every decode step, multiplied by a prompt's last token only."""
    return config["hidden_size"] * config["vocab_size"]


def kv_bytes_per_token(config: dict, element: int) -> int:
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * element


def model_dir(shape: str, root: Path) -> Path:
    """A checkpoint directory with the shape's config.json and a byte-level tokenizer, no weights."""
    from tests.harness.tiny_models import byte_tokenizer
    out = root / shape
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(SHAPES[shape]))
    byte_tokenizer().save_pretrained(out)
    return out


def build(model: Path, dtype: str, mode: str, kv_gb: float, max_batch: int, max_len: int, max_prefill: int):
    from splitserve.engine import LLM
    start = time.perf_counter()
    llm = LLM(str(model), dtype=dtype, load_format="dummy", enforce_eager=mode == "eager", max_num_seqs=max_batch,
              max_num_batched_tokens=max(max_prefill, max_batch), kv_cache_memory_gb=kv_gb,
              enable_prefix_caching=False, max_model_len=max_len)
    return llm, time.perf_counter() - start


def prefill_seconds(llm, tokens: int, iters: int) -> float:
    """Median seconds of one engine step that prefills a ``tokens``-token prompt in one chunk."""
    from splitserve.engine import SamplingParams
    engine = llm.engine
    times = []
    for i in range(iters + 1):
        prompt = [(i * 7 + j * 13) % 250 + 3 for j in range(tokens)]
        engine.add_request(f"prefill-{tokens}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=1,
                                                                          ignore_eos=True))
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    return median(times)


def run(args) -> dict:
    from bench.step_time import measure
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    element = torch.empty((), dtype=dtype).element_size()
    config = SHAPES[args.shape]
    bandwidth = copy_bandwidth(device, args.copy_mib)
    flops = matmul_rate(device, dtype, args.matmul_n)
    params = layer_parameters(config)
    weight_bytes = (params + head_parameters(config)) * element
    per_token = kv_bytes_per_token(config, element)
    cells = [(b, c) for c in args.contexts for b in args.batches]
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        room = free - weight_bytes - args.headroom_gb * 2**30
    else:
        room = args.kv_gb_cpu * 2**30
    fits = [(b, c) for b, c in cells if b * (c + 64) * per_token <= room]
    need = max([b * (c + 64) * per_token for b, c in fits] + [max(args.prefill) * per_token]) * 1.1
    with tempfile.TemporaryDirectory(prefix="splitserve-roofline-") as root:
        llm, startup_s = build(model_dir(args.shape, Path(root)), args.dtype, args.mode, need / 2**30,
                               max(b for b, _ in fits) if fits else 1, max(args.contexts + args.prefill) + 1024,
                               max(args.prefill))
        decode = []
        for batch, context in cells:
            kv = batch * context * per_token
            if (batch, context) not in fits:
                decode.append({"batch": batch, "context": context, "skipped": f"{kv / 2**30:.1f} GiB of KV does "
                               f"not fit beside {weight_bytes / 2**30:.1f} GiB of weights"})
                continue
            step_s, phases = measure(llm, batch, context, args.steps)
            floor_s = (weight_bytes + kv) / bandwidth
            decode.append({"batch": batch, "context": context, "step_ms": 1000 * step_s,
                           "tokens_per_s": batch / step_s, "weight_bytes": weight_bytes, "kv_bytes": kv,
                           "roofline_ms": 1000 * floor_s, "fraction_of_roofline": floor_s / step_s,
                           "phases_ms": phases})
        prefill = []
        for tokens in args.prefill:
            seconds = prefill_seconds(llm, tokens, args.prefill_iters)
            floor_s = 2 * (params * tokens + head_parameters(config)) / flops
            prefill.append({"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                            "roofline_s": floor_s, "fraction_of_roofline": floor_s / seconds})
        del llm
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"ok": True, "shape": args.shape, "config": config, "dtype": args.dtype, "mode": args.mode,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "copy_bytes_per_s": bandwidth, "matmul_flops": flops, "matmul_n": args.matmul_n,
            "layer_parameters": params, "head_parameters": head_parameters(config), "startup_s": startup_s,
            "decode": decode, "prefill": prefill,
            "aims": {"decode_batch_1": 0.6, "decode_batch_64": 0.5, "prefill": 0.5}}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--mode", choices=("compiled", "eager"), default="compiled")
    p.add_argument("--batches", type=_ints, default=[1, 16, 64, 256])
    p.add_argument("--contexts", type=_ints, default=[1024, 4096])
    p.add_argument("--prefill", type=_ints, default=[512, 4096])
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per cell")
    p.add_argument("--prefill-iters", type=int, default=3)
    p.add_argument("--copy-mib", type=int, default=1024)
    p.add_argument("--matmul-n", type=int, default=8192)
    p.add_argument("--headroom-gb", type=float, default=8.0, help="GPU memory left for activations and graphs")
    p.add_argument("--kv-gb-cpu", type=float, default=1.0, help="the KV pool's bound on a CPU")
    p.add_argument("--out", default="bench/results/roofline.json")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    result = run(args)
    write_json(args.out, result)
    for row in result["decode"]:
        if "skipped" in row:
            print(f"decode b{row['batch']} c{row['context']}: skipped ({row['skipped']})")
        else:
            print(f"decode b{row['batch']} c{row['context']}: {row['step_ms']:.2f} ms, roofline "
                  f"{row['roofline_ms']:.2f} ms, {row['fraction_of_roofline']:.2f} of it")
    for row in result["prefill"]:
        print(f"prefill {row['tokens']}: {row['tokens_per_s']:.0f} tok/s, {row['fraction_of_roofline']:.2f} of roofline")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
