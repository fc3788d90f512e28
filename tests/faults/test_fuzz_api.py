"""Property-based fuzzing of the public API through a real stack (gateway + prefill + decode + Redis).

Hypothesis builds every public request message with wild values: NaN/inf/huge/negative
floats, integers at their wire-type bounds, unicode and NUL bytes, huge prompts and stop
lists, out-of-vocabulary token ids, several prompt kinds at once, request ids with odd
characters, fields far past the gateway's size limits. Every answer must be OK or a precise
client-error status; never INTERNAL, UNKNOWN, UNAVAILABLE... and the service must stay up:
health SERVING after every example, every process alive, and afterwards every worker's KV
pages back at baseline with no live request left in Redis. A request that is legal but for one
field just or far past its limit must be INVALID_ARGUMENT naming that field.

A Generate that is accepted is read for at most ``READ_BUDGET`` (messages and seconds), then
cancelled by the client: huge ``max_tokens`` must not make the suite slow, and the cut
exercises the cancel path too. Fuzzed Generate requests also come from clients that stop
reading for longer than the gateway's ``--slow-reader-timeout-s``, several at once: each ends OK (its output fit
the window, or it ended first) or with a client-error status, never hangs, and nothing leaks.
The strategies live in ``tests/harness/fuzz_api.py``; the long version is ``bench/fuzz.py``
(more examples, counts per status code in JSON).
"""
from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from splitserve.common.limits import RequestLimits
from tests.harness.fuzz_api import (ALLOWED, CHAT_TEMPLATE, call, describe, long_streams, oversized_requests,
                                        requests, stalled_call)
from tests.harness.stack import live_request_keys, queued_request_ids, start_stack, wait_pages_at_baseline
from splitserve.v1 import generation_pb2


# The tiny test Llama's context (max_position_embeddings; the gateway gets no --max-model-len).
MAX_MODEL_LEN = 1024
# The gateway cuts a stream whose message waits this long for its client; stalled clients stop
# reading for a second longer (a stream the gateway had not cut by then is served, which is
# allowed too: tests/faults/test_slow_readers.py checks the cut itself).
SLOW_READER_TIMEOUT_S = 2.0
STALL_S = SLOW_READER_TIMEOUT_S + 1.0


# ---- the tests -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_model(tiny_model_dirs, tmp_path_factory):
    """The tiny Llama plus a chat template that refuses some conversations."""
    path = tmp_path_factory.mktemp("fuzz-model") / "llama"
    shutil.copytree(tiny_model_dirs["llama"], path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def stack(fuzz_model, tmp_path_factory):
    # Decode reservations outlive every wait here: leaked pages cannot come back by lease expiry.
    running = start_stack(fuzz_model, tmp_path_factory, prefill=1, decode=1,
                          worker_args=["--num-threads", "1"], role_args={"decode": ["--lease-ttl-s", "600"]},
                          gateway_args=["--slow-reader-timeout-s", str(SLOW_READER_TIMEOUT_S)])
    try:
        running.baseline = running.free_pages()
        yield running
    finally:
        running.close()


def assert_up(stack) -> None:
    dead = {name: p.returncode for name, p in stack.procs.items() if p.poll() is not None}
    assert not dead, f"processes exited: {dead}"
    health = health_pb2_grpc.HealthStub(stack.client.channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="splitserve.v1.Generation"), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


@settings(max_examples=60, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(item=requests())
def test_every_answer_is_ok_or_a_client_error(stack, item):
    rpc, request = item
    code, details = call(stack.stub, rpc, request)
    event(f"{rpc}: {code}{' (cut)' if details == 'cut by the client' else ''}")  # --hypothesis-show-statistics
    assert code in ALLOWED, f"{code} {details!r} for {describe(rpc, request)}"
    assert_up(stack)


@pytest.fixture(scope="module")
def limits(fuzz_model) -> RequestLimits:
    """The limits the gateway derives for the fuzz model (no limit flag given)."""
    return RequestLimits().resolve(MAX_MODEL_LEN, AutoTokenizer.from_pretrained(fuzz_model))


@settings(max_examples=30, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(data=st.data())
def test_a_field_past_its_limit_is_invalid_argument_naming_it(stack, limits, data):
    rpc, path, request = data.draw(oversized_requests(limits, MAX_MODEL_LEN))
    event(f"{rpc}: {path}")
    code, details = call(stack.stub, rpc, request)
    assert code == "INVALID_ARGUMENT" and details.startswith(path), f"{code} {details!r} for {describe(rpc, request)}"


# Why a stalled client's request may end RESOURCE_EXHAUSTED (anything else is a wrong answer).
STALL_REASONS = ("did not read its stream", "--max-buffered-tokens-per-stream", "--max-buffered-bytes", "queue full")


# Stalled clients per example, all at once: each stall is a few seconds of waiting, and ten in a
# row took 33 s of the suite; at once they also load the gateway's shared output budget.
STALLED_AT_ONCE = 5


@settings(max_examples=3, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(stalls=st.lists(st.tuples(long_streams(), st.integers(0, 3)), min_size=STALLED_AT_ONCE,
                       max_size=STALLED_AT_ONCE))
def test_clients_that_stop_reading_are_cut_or_served(stack, stalls):
    with ThreadPoolExecutor(len(stalls)) as pool:
        answers = list(pool.map(lambda s: stalled_call(stack.gateway_address, s[0], s[1], STALL_S), stalls))
    for (request, _), (code, details) in zip(stalls, answers):
        event(f"stalled Generate: {code}")
        assert code in ALLOWED, f"{code} {details!r} for {describe('Generate', request)}"
        if code == "RESOURCE_EXHAUSTED":
            assert any(reason in details for reason in STALL_REASONS), details
    assert_up(stack)


def test_out_of_vocab_stop_token_is_refused_before_any_page_is_reserved(stack):
    # Found by the fuzzing: the gateway let it through, the prefill worker refused it, and the
    # decode worker's reservation stayed held until its lease ran out.
    request = generation_pb2.GenerateRequest(token_ids=list(range(1, 60)), sampling=generation_pb2.SamplingParams(
        max_tokens=4, stop_token_ids=[7, 100_000]))
    wait_pages_at_baseline(stack, stack.baseline, timeout_s=60)  # cut streams of the fuzzing end first
    with pytest.raises(grpc.RpcError) as err:
        list(stack.stub.Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.stop_token_ids[1]" in err.value.details()
    assert stack.free_pages() == stack.baseline


def test_the_service_is_intact_after_the_fuzzing(stack):
    assert_up(stack)
    # Nothing leaked: every page back (cut streams included), nothing live or queued in Redis.
    wait_pages_at_baseline(stack, stack.baseline, timeout_s=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        live, queues = live_request_keys(stack.redis), queued_request_ids(stack.redis)
        if not live and not any(queues.values()):
            break
        time.sleep(0.2)
    assert live == [] and queues == {"pending": [], "inflight": []}, (live, queues)
    # And it still answers a plain request correctly.
    out = list(stack.stub.Generate(generation_pb2.GenerateRequest(
        token_ids=[1, 2, 3], sampling=generation_pb2.SamplingParams(max_tokens=4, temperature=0.0,
                                                                    ignore_eos=True)), timeout=60))
    assert out[-1].final.finish_reason == "length" and out[-1].final.usage.completion_tokens == 4
