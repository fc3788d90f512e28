"""The Python client against a real stack (Redis, a gateway, one colocated worker, the tiny
Llama): every call it offers, the request id on every event, logprobs on the events, the
async client's abort, and the channel's retry of a request refused before its first token."""
import asyncio
import signal
import threading
import time

import grpc
import pytest

from splitserve.client import AsyncClient, Client
from splitserve.common.errors import RETRY_PUSHBACK_METADATA_KEY
from tests.harness.stack import start_process, start_stack, stop_process, wait_pages_at_baseline, worker_info
from tests.harness.tools import scrape

PROMPT = [40 + i % 50 for i in range(19)]  # token ids of the tiny byte-level model


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    running = start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=0, decode=0, both=1)
    try:
        yield running
    finally:
        running.close()


def test_every_event_names_its_request_and_carries_logprobs(stack, llama_reference):
    events = list(stack.client.generate(PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2,
                                        timeout=60))
    request_id = events[0].request_id
    assert request_id and all(e.request_id == request_id for e in events)  # the server made it up
    tokens = [t for e in events for t in e.token_ids]
    assert tokens == llama_reference.greedy(PROMPT, 6)
    logprobs = [lp for e in events for lp in e.logprobs]
    assert [lp.token_id for lp in logprobs] == tokens
    assert all(len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob for lp in logprobs)
    final = events[-1]
    assert final.finished and final.error == ""
    info = stack.client.get_request(request_id)
    assert (info.state, info.finish_reason) == ("finished", "length")


def test_tokenize_detokenize_and_model_info(stack):
    info = stack.client.model_info()
    assert info.vocab_size > 0 and info.max_model_len > 0
    ids = stack.client.tokenize("hello, world")
    assert ids and stack.client.detokenize(ids) == "hello, world"
    with pytest.raises(grpc.RpcError) as e:
        stack.client.detokenize([info.vocab_size])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocab_size" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stack.client.get_request("no-such-request")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_async_client_aborts_a_running_request_by_the_id_of_its_first_event(stack):
    baseline = stack.free_pages()

    async def main():
        async with AsyncClient(stack.gateway_address) as client:
            assert (await client.model_info()).vocab_size > 0
            assert await client.detokenize(await client.tokenize("abc")) == "abc"
            stream = client.generate(PROMPT, max_tokens=400, ignore_eos=True, timeout=60)
            first = await stream.__anext__()
            assert await client.abort(first.request_id)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stream:
                    pass
            assert e.value.code() == grpc.StatusCode.CANCELLED
            return first.request_id, (await client.get_request(first.request_id)).state
    request_id, state = asyncio.run(main())
    assert state == "aborted", request_id
    wait_pages_at_baseline(stack, baseline)


def test_a_request_refused_for_a_full_queue_is_retried_by_a_retrying_client(stack, tmp_path):
    """A second gateway with --queue-limit 1: while one request runs, another is refused with
    RESOURCE_EXHAUSTED and gRPC's pushback; the default client sees the refusal, a client with
    retry=True waits the pushback, retries and gets its answer once room is free."""
    gateway, address = start_process([*stack.argv["gateway"], "--queue-limit", "1"], tmp_path / "gateway.log")
    try:
        with Client(address) as plain, Client(address, retry=True) as retrying:
            holder = plain.generate(PROMPT, max_tokens=1000, ignore_eos=True, timeout=60)
            first = next(holder)  # it runs: the one place in the queue is taken
            with pytest.raises(grpc.RpcError) as e:
                list(plain.generate(PROMPT, max_tokens=2, timeout=30))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert int(dict(e.value.trailing_metadata())[RETRY_PUSHBACK_METADATA_KEY]) > 0
            answer = []
            waiter = threading.Thread(target=lambda: answer.extend(
                retrying.generate(PROMPT, max_tokens=2, ignore_eos=True, timeout=60)))
            waiter.start()
            time.sleep(0.5)  # its first try is refused; the channel waits the pushback
            assert waiter.is_alive() and not answer
            assert plain.abort(first.request_id)  # room again
            waiter.join(60)
            assert answer and answer[-1].finished and answer[-1].finish_reason == "length", answer
    finally:
        stop_process(gateway, tmp_path / "gateway.log")


def test_a_stop_string_matched_at_the_gateway_stops_the_worker_too(stack, llama_reference):
    """The gateway matches stop strings on the text; the worker, which only knows token ids,
    must hear of it and stop generating (it used to go on to max_tokens, holding its pages)."""
    reference = llama_reference.greedy(PROMPT, 40)
    text = stack.client.detokenize(reference)
    stop = next(text[i:i + 2] for i in range(4, len(text)) if text[i:i + 2] not in text[:i + 1] and
                text[i:i + 2].strip() == text[i:i + 2] and len(text[i:i + 2]) == 2)
    name = stack.names("both")[0]
    before = scrape(stack.metrics_ports[name])["splitserve:engine_generation_tokens_total"]
    *_, final = stack.client.generate(PROMPT, max_tokens=900, temperature=0.0, ignore_eos=True, stop=[stop],
                                      timeout=120)
    assert final.finish_reason == "stop" and final.usage.completion_tokens < 40
    deadline = time.monotonic() + 120
    while worker_info(stack.worker_stub(name)).num_running:  # the worker let go of it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    generated = scrape(stack.metrics_ports[name])["splitserve:engine_generation_tokens_total"] - before
    assert generated < 100, f"the worker generated {generated:.0f} tokens for a request stopped after " \
                            f"{final.usage.completion_tokens}"


def test_a_retrying_client_gives_up_within_the_deadline_on_a_gateway_that_refuses(stack, tmp_path):
    """Every try refused (a draining gateway): the last refusal comes back, never a hang (gRPC's
    own retryPolicy hung past the deadline here, which is why the client retries itself)."""
    gateway, address = start_process(stack.argv["gateway"], tmp_path / "gateway-draining.log")
    try:
        with Client(address, retry=True) as client:
            assert client.model_info().vocab_size > 0
            gateway.send_signal(signal.SIGTERM)  # drains: new requests are refused with UNAVAILABLE
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                list(client.generate(PROMPT, max_tokens=2, timeout=20))
            # UNAVAILABLE while it drains; once it stops, a try in flight is CANCELLED by the
            # server's stop, then the port refuses (UNAVAILABLE): whichever the last try met.
            assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            assert time.monotonic() - started < 25
    finally:
        gateway.kill()
        gateway.wait(30)
