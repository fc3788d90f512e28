"""Conditional disaggregation in a served stack (``--disaggregation``, splitserve/gateway/prefill_placement.py):
under ``auto`` a short prompt, or one whose head the decode worker caches, is prefilled on the
decode worker, a long one on the prefill worker; under ``never`` a decode worker serves alone.
Every answer is transformers' greedy one, every decision shows in the gateway's metrics and the
request's timeline, and every page comes back."""
import threading

import pytest

from splitserve.engine.block_pool import prefix_block_hashes
from splitserve.state import prefixes
from splitserve.state.store import RedisState
from splitserve.v1 import generation_pb2
from tests.harness.stack import start_stack, wait_pages_at_baseline
from tests.harness.streams import wait_until
from tests.harness.tools import scrape

BLOCK = 8  # the test stacks' --block-size
LOCAL_LIMIT = 24  # the auto gateway's --local-prefill-tokens


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    running = start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=1,
                          gateway_args=["--disaggregation", "auto", "--local-prefill-tokens", str(LOCAL_LIMIT)])
    try:
        yield running
    finally:
        running.close()


def prompt_of(first: int, n: int) -> list[int]:
    return [first] + [40 + (first * 7 + i * 3) % 60 for i in range(n - 1)]


def generate(client, prompt, max_tokens=4):
    events = list(client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=120))
    return [t for e in events for t in e.token_ids], events[-1]


def placements(stack) -> dict[tuple[str, str], float]:
    prefix = "splitserve:prefill_placements_total{"
    return {tuple(v.split("=")[1] for v in key[len(prefix):-1].split(",")): value
            for key, value in scrape(stack.metrics_ports["gateway"]).items() if key.startswith(prefix)}


def grew(before: dict, after: dict) -> dict:
    return {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}


def test_auto_prefills_short_prompts_locally_and_long_ones_remotely(stack, llama_reference):
    baseline = stack.free_pages()
    before = placements(stack)
    # At once, so local prefills and handed-off prompts share the decode worker's steps.
    prompts = [prompt_of(3, 12), prompt_of(4, 90), prompt_of(5, LOCAL_LIMIT), prompt_of(6, LOCAL_LIMIT + 1),
               prompt_of(7, 5), prompt_of(8, 60)]
    results: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda i=i, p=p: results.update({i: generate(stack.client, p, 6)}))
               for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, prompt in enumerate(prompts):
        tokens, final = results[i]
        assert tokens == llama_reference.greedy(prompt, 6), i
        remote = len(prompt) > LOCAL_LIMIT
        assert bool(final.timeline.prefill_worker) == remote, (i, len(prompt), final.timeline.prefill_worker)
        assert final.timeline.decode_worker
    # Prefill workers idle: no queue rule fired; each decision counted under its reason.
    assert grew(before, placements(stack)) == {("short_prompt", "local"): 3.0, ("long_prompt", "remote"): 3.0}
    wait_pages_at_baseline(stack, baseline)


def test_auto_prefills_the_new_turn_where_the_history_is_cached(stack, llama_reference):
    """A long conversation goes remote once; its next turn computes only the new tokens, on the decode
    worker that holds the history (the prefix directory says so), and reads the history from its cache."""
    baseline = stack.free_pages()
    history = prompt_of(9, 96)
    tokens, final = generate(stack.client, history)
    assert tokens == llama_reference.greedy(history, 4) and final.timeline.prefill_worker
    decode = final.timeline.decode_worker
    state = RedisState(stack.redis.client())
    hashes = prefix_block_hashes(history, BLOCK)
    wait_until(lambda: None not in prefixes.lookup(state, [decode], hashes)[0], 10, "the decode worker's entries")
    before = placements(stack)
    turn = history + tokens + [50, 51, 52, 53]
    tokens2, final2 = generate(stack.client, turn)
    assert tokens2 == llama_reference.greedy(turn, 4)
    assert not final2.timeline.prefill_worker and final2.timeline.decode_worker == decode
    assert final2.usage.cached_prompt_tokens >= 96
    assert grew(before, placements(stack)) == {("short_prompt", "local"): 1.0}
    wait_pages_at_baseline(stack, baseline)


def test_never_a_decode_worker_serves_alone(tiny_model_dirs, tmp_path_factory, llama_reference):
    with start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=0, decode=1,
                     gateway_args=["--disaggregation", "never"]) as alone:
        baseline = alone.free_pages()
        prompts = [prompt_of(10, 70), prompt_of(11, 9)]
        for prompt in prompts:
            tokens, final = generate(alone.client, prompt)
            assert tokens == llama_reference.greedy(prompt, 4)
            assert not final.timeline.prefill_worker
        assert grew({}, placements(alone)) == {("never", "local"): 2.0}
        # A client that leaves mid-request leaves nothing behind on the decode worker.
        request = generation_pb2.GenerateRequest(token_ids=prompt_of(12, 40), sampling=generation_pb2.SamplingParams(
            max_tokens=200, temperature=0.0, ignore_eos=True))
        stream = alone.stub.Generate(request, timeout=120)
        next(stream)
        stream.cancel()
        wait_pages_at_baseline(alone, baseline)
