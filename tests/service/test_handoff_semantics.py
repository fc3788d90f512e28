"""A request handed from a prefill worker to a decode worker means what it means on one engine.

The same requests through a disaggregated stack (prefill + decode worker) and a colocated one
(one ``both`` worker) give the same tokens: seeded sampling continues the same random stream
after the handoff, and ``min_tokens`` keeps EOS and stop tokens out of the first token too. The
prefill worker's prefix-cache counters equal the cached tokens its clients are told about.
"""
import time

import pytest

from tests.harness.prompts import mixed_prompts
from tests.harness.stack import start_stack
from tests.harness.tools import scrape


@pytest.fixture(scope="module")
def stacks(tiny_model_dirs, tmp_path_factory):
    model = tiny_model_dirs["llama"]
    with start_stack(model, tmp_path_factory, prefill=1, decode=1) as disaggregated, \
            start_stack(model, tmp_path_factory, prefill=0, decode=0, both=1) as colocated:
        yield {"disaggregated": disaggregated, "colocated": colocated}


def tokens(stack, prompt, **sampling):
    out, final = [], None
    for event in stack.client.generate(prompt, timeout=60, **sampling):
        if event.finished:
            final = event
        else:
            out += event.token_ids
    return out, final


def settled(port: int, keys, quiet_s: float = 1.5, timeout_s: float = 20.0) -> dict:
    """The metrics once ``keys`` stopped moving for ``quiet_s`` (counters are copied from the
    engine every half second, so a request that just ended may not be counted yet)."""
    give_up = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while True:
        now = scrape(port)
        values = [now.get(k, 0.0) for k in keys]
        if values != last:
            last, since = values, time.monotonic()
        elif time.monotonic() - since >= quiet_s or time.monotonic() > give_up:
            return now
        time.sleep(0.25)


def test_seeded_sampling_continues_the_same_random_stream_after_the_handoff(stacks):
    prompts = mixed_prompts(4, seed=141, lo=8, hi=40)
    sampling = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    for prompt in prompts:
        colocated, _ = tokens(stacks["colocated"], prompt, seed=1234, **sampling)
        assert tokens(stacks["disaggregated"], prompt, seed=1234, **sampling)[0] == colocated
    # The seed decides the tokens (so the comparison above could fail).
    assert any(tokens(stacks["colocated"], p, seed=1234, **sampling)[0] !=
               tokens(stacks["colocated"], p, seed=4321, **sampling)[0] for p in prompts)


def test_min_tokens_keeps_a_stop_token_out_of_the_first_token(stacks, llama_reference):
    for prompt in mixed_prompts(3, seed=142, lo=8, hi=40):
        greedy_first = llama_reference.greedy(prompt, 1)[0]
        # The greedy first token is a stop token, which min_tokens=2 forbids as the first token.
        sampling = dict(temperature=0.0, max_tokens=4, min_tokens=2, stop_token_ids=[greedy_first], ignore_eos=True)
        colocated, final = tokens(stacks["colocated"], prompt, **sampling)
        assert colocated[0] != greedy_first and len(colocated) >= 2, final.finish_reason
        assert tokens(stacks["disaggregated"], prompt, **sampling)[0] == colocated


def test_prefix_cache_counters_equal_the_cached_tokens_clients_are_told(stacks):
    stack = stacks["disaggregated"]
    port = stack.metrics_ports["prefill"]
    keys = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    before = settled(port, keys)  # the earlier tests' requests counted
    prompt = mixed_prompts(1, seed=143, lo=41, hi=41)[0]  # block size 8: 5 full blocks before the last token
    cached = [tokens(stack, prompt, max_tokens=2, temperature=0.0)[1].usage.cached_prompt_tokens for _ in range(3)]
    assert cached == [0, 40, 40]
    give_up = time.monotonic() + 10  # engine gauges and counters refresh on the engine thread every 0.5 s
    while True:
        after = scrape(port)
        delta = [after.get(k, 0.0) - before.get(k, 0.0) for k in keys]
        if delta == [3 * 41, sum(cached)] or time.monotonic() > give_up:
            break
        time.sleep(0.2)
    assert delta == [3 * 41, sum(cached)]
    # The colocated worker tells its clients too.
    colocated = [tokens(stacks["colocated"], prompt, max_tokens=2, temperature=0.0)[1].usage.cached_prompt_tokens
                 for _ in range(2)]
    assert colocated == [0, 40]
