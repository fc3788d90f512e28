"""Keepalive: a client that vanishes without closing its connection (a cut cable, a power loss)
is noticed by the gateway's pings, its request ends and its pages are freed -- not when the
request would have ended, nor at the slow-reader timeout.

The gateway runs with a 1 s ping interval and a 1 s ack timeout (the same options as in
production, only shorter: ``splitserve.common.grpc_options.server_options``); the worker steps slowly
(50 ms), so the request would run ~45 s; the client talks through a relay that goes silent.
"""
import time

import grpc
import pytest

from splitserve.client import Client
from splitserve.common.grpc_options import KEEPALIVE_TIMEOUT_ENV, SERVER_KEEPALIVE_ENV
from tests.harness.hostile import Blackhole
from tests.harness.stack import start_stack, wait_pages_at_baseline

PROMPT = [40 + i % 50 for i in range(19)]
# Bound on noticing the silence: a ping after 1 s, 1 s for its ack, a step's delay, slack for a
# loaded box; far below the 30 s slow-reader timeout and the ~45 s the request would run.
NOTICED_WITHIN_S = 12.0


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    running = start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=0, decode=0, both=1,
                          role_env={"gateway": {SERVER_KEEPALIVE_ENV: "1", KEEPALIVE_TIMEOUT_ENV: "1"},
                                    "both": {"SPLITSERVE_FAULT_STEP_DELAY_S": "0.05"}})
    try:
        yield running
    finally:
        running.close()


def test_a_client_that_went_silent_is_dropped_by_the_gateways_pings(stack):
    baseline = stack.free_pages()
    relay = Blackhole(stack.gateway_address)
    client = Client(relay.address)
    try:
        events = client.generate(PROMPT, max_tokens=900, temperature=0.0, ignore_eos=True, timeout=120)
        first = next(events)
        next(events)
        relay.freeze()
        cut_at = time.monotonic()
        wait_pages_at_baseline(stack, baseline, timeout_s=NOTICED_WITHIN_S)
        noticed_s = time.monotonic() - cut_at
        give_up = time.monotonic() + 5
        while (info := stack.client.get_request(first.request_id)).state != "aborted":
            assert time.monotonic() < give_up, info
            time.sleep(0.05)
        assert info.finish_reason == "aborted"
        # The request was far from its end: it stopped because its client was gone.
        assert noticed_s < NOTICED_WITHIN_S
    finally:
        relay.close()
        client.close()


def test_the_silent_relay_really_stalls_a_stream_without_closing_it(stack):
    """The relay itself: frozen, the client's stream stalls (no status, no bytes) until its own
    deadline -- so the test above measures the gateway's pings, not a closed socket."""
    relay = Blackhole(stack.gateway_address)
    client = Client(relay.address)
    try:
        events = client.generate(PROMPT, max_tokens=900, temperature=0.0, ignore_eos=True, timeout=3)
        next(events)
        relay.freeze()
        with pytest.raises(grpc.RpcError) as e:
            for _ in events:
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        relay.close()
        client.close()
