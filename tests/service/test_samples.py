"""``n`` > 1 against real stacks (Redis, a gateway, workers, the tiny Llama), over gRPC and HTTP.

The samples of one request share its prompt's KV: the prompt is prefilled and sent once, the
later samples reuse the prefill worker's prefix cache and the decode worker's pages (only each
one's last partial page is computed and sent). Greedy samples equal transformers; seeded ones
equal separate requests seeded seed + i; an abort by the request's id ends every sample and
gives every page back.
"""
import asyncio
import time

import grpc
import openai
import pytest

from splitserve.client import AsyncClient
from tests.harness.stack import start_stack, wait_pages_at_baseline
from tests.harness.tools import scrape

BLOCK = 8  # the test stacks' --block-size


def prompt_of(first: int, length: int = 41) -> list[int]:
    """Token ids of the tiny byte-level model; different ``first`` share no page."""
    return [first] + [40 + i % 50 for i in range(length - 1)]


@pytest.fixture(scope="module")
def split_stack(tiny_model_dirs, tmp_path_factory):
    running = start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=1, http=True)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(scope="module")
def colocated_stack(tiny_model_dirs, tmp_path_factory):
    running = start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=0, decode=0, both=1)
    try:
        yield running
    finally:
        running.close()


def by_index(events) -> dict[int, list]:
    samples: dict[int, list] = {}
    for event in events:
        samples.setdefault(event.index, []).append(event)
    return samples


def tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def transfer_bytes(stack) -> float:
    samples = scrape(stack.metrics_ports["prefill"])
    return sum(v for k, v in samples.items() if k.startswith("splitserve:kv_transfer_bytes_total"))


def test_greedy_samples_equal_transformers_and_share_the_prompt_pages(split_stack, llama_reference):
    baseline = split_stack.free_pages()
    before = transfer_bytes(split_stack)
    one = list(split_stack.client.generate(prompt_of(1), max_tokens=6, temperature=0.0, ignore_eos=True, timeout=60))
    single = transfer_bytes(split_stack) - before
    prompt = prompt_of(2)
    before = transfer_bytes(split_stack)
    events = list(split_stack.client.generate(prompt, n=3, max_tokens=6, temperature=0.0, ignore_eos=True,
                                              timeout=60))
    shared = transfer_bytes(split_stack) - before
    assert tokens(one) == llama_reference.greedy(prompt_of(1), 6)
    samples = by_index(events)
    assert sorted(samples) == [0, 1, 2]
    request_id = events[0].request_id
    assert all(e.request_id == request_id for e in events)
    for index, sample in samples.items():
        assert tokens(sample) == llama_reference.greedy(prompt, 6), index
        final = sample[-1]
        assert final.finished and final.finish_reason == "length" and [e for e in sample if e.finished] == [final]
        assert final.usage.prompt_tokens == len(prompt) and final.usage.completion_tokens == 6
    # The later samples found the prompt's full pages in the prefill worker's prefix cache...
    cached = (len(prompt) - 1) // BLOCK * BLOCK
    assert [samples[i][-1].usage.cached_prompt_tokens for i in (1, 2)] == [cached, cached]
    # ...and in the decode worker's: 41 tokens are 6 pages; the first sample sent 6, the others
    # their last page only (8 pages for 3 samples, where 3 separate requests send 18).
    assert single > 0 and shared * 6 == single * 8
    wait_pages_at_baseline(split_stack, baseline)


def test_seeded_samples_equal_separate_requests_seeded_seed_plus_index(split_stack):
    prompt = prompt_of(3, 20)
    params = dict(max_tokens=8, temperature=1.0, top_k=20, ignore_eos=True, timeout=60)
    samples = by_index(split_stack.client.generate(prompt, n=3, seed=1234, **params))
    for index in range(3):
        alone = list(split_stack.client.generate(prompt, seed=1234 + index, **params))
        assert tokens(samples[index]) == tokens(alone), index
    assert len({tuple(tokens(s)) for s in samples.values()}) > 1  # they are independent samples


def test_aborting_the_request_ends_every_sample_and_frees_every_page(split_stack):
    baseline = split_stack.free_pages()

    async def main():
        async with AsyncClient(split_stack.gateway_address) as client:
            stream = client.generate(prompt_of(4), n=3, max_tokens=900, ignore_eos=True, timeout=60)
            seen = set()
            async for event in stream:  # until every sample streams: all three are running
                seen.add(event.index)
                if seen == {0, 1, 2}:
                    break
            assert await client.abort(event.request_id)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stream:
                    pass
            assert e.value.code() == grpc.StatusCode.CANCELLED
            return event.request_id
    request_id = asyncio.run(main())
    # Each sample's end reaches Redis on its own write, just after the call ended.
    ids = [request_id, f"{request_id}/1", f"{request_id}/2"]
    give_up = time.monotonic() + 10
    while (states := [split_stack.client.get_request(i).state for i in ids]) != ["aborted"] * 3:
        assert time.monotonic() < give_up, states
        time.sleep(0.05)
    wait_pages_at_baseline(split_stack, baseline)


def test_n_out_of_range_is_invalid_argument(split_stack):
    for n in (0, 17):
        with pytest.raises(grpc.RpcError) as e:
            list(split_stack.client.generate(prompt_of(5), n=n, max_tokens=2, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"sampling.n must be in [1, 16], got {n}" in e.value.details()


def test_openai_n_gives_one_choice_per_sample_whole_and_streamed(split_stack):
    with openai.OpenAI(base_url=split_stack.http + "/v1", api_key="unused", max_retries=0) as client:
        prompt = prompt_of(6, 20)
        whole = client.completions.create(model=split_stack.model, prompt=prompt, n=2, max_tokens=5, seed=7,
                                          temperature=1.0, extra_body={"ignore_eos": True, "return_token_ids": True})
        assert [c.index for c in whole.choices] == [0, 1]
        assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == 10
        texts = {0: "", 1: ""}
        finish = {}
        usage = None
        stream = client.completions.create(model=split_stack.model, prompt=prompt, n=2, max_tokens=5, seed=7,
                                           temperature=1.0, stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                if choice.finish_reason is not None:
                    finish[choice.index] = choice.finish_reason
        assert finish == {0: "length", 1: "length"}
        # The same seed gives the same samples, whole or streamed.
        assert texts == {c.index: c.text for c in whole.choices}
        assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == 10


def test_colocated_samples_continue_from_the_engines_prefix_cache(colocated_stack, llama_reference):
    baseline = colocated_stack.free_pages()
    prompt = prompt_of(7)
    samples = by_index(colocated_stack.client.generate(prompt, n=3, max_tokens=5, temperature=0.0, ignore_eos=True,
                                                       timeout=60))
    cached = (len(prompt) - 1) // BLOCK * BLOCK
    for index in range(3):
        assert tokens(samples[index]) == llama_reference.greedy(prompt, 5), index
        assert samples[index][-1].usage.cached_prompt_tokens == (cached if index else 0)
    wait_pages_at_baseline(colocated_stack, baseline)
