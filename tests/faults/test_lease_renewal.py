"""A prefill that outlasts the decode worker's lease keeps its pages (issue 20), with real processes.

The decode worker's lease is short (``--lease-ttl-s 1.5``) and every prefill step is made at
least 0.5 s long (``SPLITSERVE_FAULT_STEP_DELAY_S``), so a 96-token prompt in 16-token chunks
prefills for at least 3 s: two leases. The gateway renews the lease while the prefill is under
way, so the request (and a short one queued behind it on the prefill worker) finishes on its
first attempt, and no lease expires. DEADLINE_EXCEEDED stays the client's: only a request whose
own deadline passes gets it.
"""
import grpc
import pytest

from tests.harness.prompts import mixed_prompts
from tests.harness.stack import start_stack, wait_pages_at_baseline
from tests.harness.streams import Stream, assert_all_match, busy, join_all, wait_until
from tests.harness.tools import scrape

LEASE_S = 1.5
STEP_DELAY_S = 0.5
CHUNK = 16


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    with start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=1,
                     worker_args=["--max-num-batched-tokens", str(CHUNK)],
                     role_args={"decode": ["--lease-ttl-s", str(LEASE_S)]},
                     role_env={"prefill": {"SPLITSERVE_FAULT_STEP_DELAY_S": str(STEP_DELAY_S)}}) as st:
        yield st


def decode_metric(stack, name: str) -> float:
    return scrape(stack.metrics_ports["decode"]).get(name, 0.0)


def test_a_prefill_longer_than_the_lease_and_one_queued_behind_it_keep_their_pages(stack, reference, baseline):
    renewals0 = decode_metric(stack, "splitserve:kv_lease_renewals_total")
    expiries0 = decode_metric(stack, "splitserve:kv_lease_expiries_total")
    [long_prompt] = mixed_prompts(1, seed=31, lo=6 * CHUNK, hi=6 * CHUNK)
    [short_prompt] = mixed_prompts(1, seed=32, lo=5, hi=5)
    long = Stream(stack.client, "lease-long", long_prompt, max_tokens=8)
    long.start()
    wait_until(lambda: busy(stack, "prefill"), 60, "the long prompt to reach the prefill worker")
    short = Stream(stack.client, "lease-short", short_prompt, max_tokens=8)  # waits behind it there
    short.start()
    join_all([long, short])
    assert_all_match([long, short], reference)
    assert [long.attempts(), short.attempts()] == [1, 1], "a lease lapsed under a prefill and voided its handoff"
    # The scenario is what it says: the sleeps alone make the long prefill outlast two leases.
    assert long.final.timeline.prefill_ms >= 6 * STEP_DELAY_S * 1000 >= 2 * LEASE_S * 1000
    assert decode_metric(stack, "splitserve:kv_lease_renewals_total") > renewals0
    assert decode_metric(stack, "splitserve:kv_lease_expiries_total") == expiries0
    wait_pages_at_baseline(stack, baseline)


def test_the_clients_own_deadline_still_ends_a_long_prefill_with_deadline_exceeded(stack, baseline):
    [prompt] = mixed_prompts(1, seed=33, lo=6 * CHUNK, hi=6 * CHUNK)
    with pytest.raises(grpc.RpcError) as err:
        list(stack.client.generate(prompt, request_id="lease-deadline", max_tokens=8, temperature=0.0,
                                   timeout=STEP_DELAY_S * 3))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_pages_at_baseline(stack, baseline)
