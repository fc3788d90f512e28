"""Speculative decoding on a running decode worker, after a KV handoff: the stream carries several
tokens per step where proposals are accepted, greedy output stays transformers', and the worker
exports vLLM's spec_decode counters (the gateway's token counts still add up)."""
from __future__ import annotations

from tests.harness.prompts import mixed_prompts
from tests.harness.stack import start_stack
from tests.harness.tools import scrape


def test_ngram_on_a_decode_worker(tiny_model_dirs, tmp_path_factory, llama_reference):
    spec = ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--prompt-lookup-min", "1"]
    with start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=1, worker_args=spec) as stack:
        before = scrape(stack.metrics_ports["decode"])
        prompts = [p * 3 for p in mixed_prompts(4, seed=5, lo=4, hi=12)]  # lookup finds 1-grams at least
        generated = 0
        for prompt in prompts:
            chunks = list(stack.client.generate(prompt, max_tokens=24, temperature=0.0, ignore_eos=True, timeout=120))
            tokens = [t for c in chunks for t in c.token_ids]
            assert tokens == llama_reference.greedy(prompt, 24)
            generated += len(tokens)
        after = scrape(stack.metrics_ports["decode"])
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    drafts = delta["vllm:spec_decode_num_drafts_total"]
    draft_tokens = delta["vllm:spec_decode_num_draft_tokens_total"]
    accepted = delta["vllm:spec_decode_num_accepted_tokens_total"]
    assert 0 < drafts <= draft_tokens <= 3 * drafts
    assert 0 <= accepted <= draft_tokens
    # Every token after the prefill worker's first was sampled here, several per step or not.
    assert delta["splitserve:engine_generation_tokens_total"] == generated - len(prompts)
