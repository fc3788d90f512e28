"""A request handed from a prefill worker to a decode worker means what it means on one engine.

The same requests through a disaggregated stack (prefill + decode worker) and a colocated one
(one ``both`` worker) give the same tokens: seeded sampling continues the same random stream
after the handoff, and ``min_tokens`` keeps EOS and stop tokens out of the first token too. The
prefill worker's prefix-cache counters equal the cached tokens its clients are told about.

The disaggregated stack's decode worker schedules asynchronously (``--async-scheduling on``:
each step launched before the tokens of the one before are read, as on a GPU), so each of these
comparisons also holds it to the synchronous colocated worker's tokens.
"""
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from splitserve.client import build_request
from tests.harness.prompts import mixed_prompts
from tests.harness.stack import start_stack, worker_info
from tests.harness.tools import scrape


@pytest.fixture(scope="module")
def stacks(tiny_model_dirs, tmp_path_factory):
    model = tiny_model_dirs["llama"]
    # A decode step or command that does not end within 5 s is logged with the engine thread's
    # stack: the cancelled-stream test reads the log's end if pages stay in use.
    with start_stack(model, tmp_path_factory, prefill=1, decode=1,
                     role_args={"decode": ["--async-scheduling", "on"]},
                     role_env={"decode": {"SPLITSERVE_ENGINE_STALL_WARN_S": "5"}}) as disaggregated, \
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


def test_concurrent_stops_and_a_cancel_through_an_async_decode_worker(stacks):
    """Requests that stop on a token at different steps, seeded and greedy, at once, and one stream
    cancelled mid-way: the same tokens as the colocated worker's, and every decode page back."""
    prompts = mixed_prompts(8, seed=144, lo=8, hi=40)
    greedy = [tokens(stacks["colocated"], p, temperature=0.0, max_tokens=12, ignore_eos=True)[0] for p in prompts]
    sampling = [dict(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[g[2 + i % 6]]) if i % 2 else
                dict(temperature=0.9, seed=i, max_tokens=12, ignore_eos=True) for i, g in enumerate(greedy)]
    expected = [tokens(stacks["colocated"], p, **s) for p, s in zip(prompts, sampling)]
    stack = stacks["disaggregated"]
    with ThreadPoolExecutor(len(prompts) + 1) as pool:
        cancelled = stack.stub.Generate(build_request(prompts[0], temperature=0.0, max_tokens=200, ignore_eos=True),
                                        timeout=60)
        next(cancelled)
        got = list(pool.map(lambda ps: tokens(stack, ps[0], **ps[1]), zip(prompts, sampling)))
        cancelled.cancel()
    assert [(t, f.finish_reason) for t, f in got] == [(t, f.finish_reason) for t, f in expected]
    assert any(f.finish_reason == "stop" for _, f in got)
    port = stack.metrics_ports["decode"]
    give_up = time.monotonic() + 10  # the gauge refreshes on the engine thread every 0.5 s
    while scrape(port).get("vllm:kv_cache_usage_perc") != 0.0 and time.monotonic() < give_up:
        time.sleep(0.2)
    usage = scrape(port).get("vllm:kv_cache_usage_perc")
    if usage != 0.0:  # what the engine itself says (the gauge may be stale), and the worker's log
        try:
            info = worker_info(stack.worker_stub("decode"), timeout_s=5)
        except grpc.RpcError as e:
            info = f"no answer from the engine thread: {e.code()}"
        tail = stack.log_paths["decode"].read_text().splitlines()[-15:]
        pytest.fail(f"decode pages still in use after the cancel: {usage}; GetWorkerInfo: {info}; "
                    "the decode log's end:\n" + "\n".join(tail))
    assert scrape(port).get("splitserve:engine_steps_overlapped_total", 0) > 0  # the overlap ran
