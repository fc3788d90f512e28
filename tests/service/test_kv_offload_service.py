"""The host KV tier (``--kv-offloading-size``) in served workers: a disaggregated stack whose pools
hold about two prompts. A prompt sent again after three others pushed it out of both workers'
pools is served from their tiers (the prefill worker's prefix hit, and the decode worker's
reservation, which then needs none of those pages sent) with transformers' tokens, and every
page comes back."""
import time

import pytest

from tests.harness.stack import start_stack, wait_pages_at_baseline
from tests.harness.tools import scrape

BLOCK = 8  # the test stacks' --block-size


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    running = start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=1,
                          worker_args=["--num-gpu-blocks", "24", "--kv-offloading-size", "0.001"])
    try:
        yield running
    finally:
        running.close()


def loaded_pages(stack, role: str) -> float:
    return scrape(stack.metrics_ports[role]).get("splitserve:kv_offload_pages_total{op=loaded,tier=host}", 0.0)


def transfer_bytes(stack) -> float:
    samples = scrape(stack.metrics_ports["prefill"])
    return sum(v for k, v in samples.items() if k.startswith("splitserve:kv_transfer_bytes_total"))


def test_a_prompt_pushed_out_of_both_pools_comes_back_from_their_tiers(stack, llama_reference):
    baseline = stack.free_pages()
    prompts = [[first] + [40 + (first * 7 + i) % 60 for i in range(80)] for first in (3, 4, 5, 6)]
    want = [llama_reference.greedy(p, 6) for p in prompts]

    def run(prompt):
        events = list(stack.client.generate(prompt, max_tokens=6, temperature=0.0, ignore_eos=True, timeout=60))
        return [t for e in events for t in e.token_ids]

    first_bytes = transfer_bytes(stack)
    assert run(prompts[0]) == want[0]
    first_bytes = transfer_bytes(stack) - first_bytes
    for prompt, expected in zip(prompts[1:], want[1:]):
        assert run(prompt) == expected
    before = {role: loaded_pages(stack, role) for role in ("prefill", "decode")}
    again_bytes = transfer_bytes(stack)
    assert run(prompts[0]) == want[0]
    again_bytes = transfer_bytes(stack) - again_bytes
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(loaded_pages(stack, r) - before[r] < 10 for r in before):
        time.sleep(0.1)
    # 10 full blocks of 8 of the 81-token prompt (the last token is always computed): from each tier.
    assert {r: loaded_pages(stack, r) - before[r] for r in before} == {"prefill": 10, "decode": 10}
    assert again_bytes < first_bytes / 2  # the decode worker had those pages: only the rest was sent
    wait_pages_at_baseline(stack, baseline)
