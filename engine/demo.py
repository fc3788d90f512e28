"""`make run`: one real chat answer from the default model, through the engine.

    python -m engine.demo ["your question"]
"""
from __future__ import annotations

import sys
import time

from engine import LLM, SamplingParams


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    question = argv[0] if argv else "What is the capital of France? Answer in one sentence."
    llm = LLM()  # smollm2-135m-instruct, bf16
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                           add_generation_prompt=True)
    start = time.perf_counter()
    [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=64))
    seconds = time.perf_counter() - start
    print(f"\nQ: {question}\nA: {out.text.strip()}\n")
    print(f"[{len(out.token_ids)} tokens in {seconds:.2f} s, finish_reason={out.finish_reason}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
