"""Redis killed and restarted under a running stack (real processes, append-only Redis).

While Redis is down the gateway answers UNAVAILABLE at once and reports NOT_SERVING; it
recovers on its own when Redis is back; requests waiting in the queue survive the restart
(append-only file, fsync always) and finish with the right tokens.
"""
import time

import grpc
import pytest

from splitserve.client import Client
from splitserve.gateway.workers import REFRESH_S
from tests.harness.prompts import mixed_prompts
from tests.harness.stack import (NOT_SERVING, SERVING, gateway_health, live_request_keys, queued_request_ids,
                                      start_process, start_stack, stop_process, wait_pages_at_baseline)
from tests.harness.streams import assert_all_match, frozen, join_all, run_streams, wait_until



@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    # 12 pages of 8 tokens: one 60-token prompt at a time fits, so the others wait in the queue.
    with start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=1,
                     worker_args=["--num-gpu-blocks", "12"],
                     redis_kwargs={"appendonly": True, "appendfsync": "always",
                                   "dir": tmp_path_factory.mktemp("redis-data")}) as st:
        yield st


def test_redis_down_means_unavailable_at_once_then_recovery(stack, reference):
    baseline = stack.free_pages()
    stack.redis.kill()
    try:
        with pytest.raises(grpc.RpcError) as err:
            # The RPC deadline is the bound on "at once": a hang would end as DEADLINE_EXCEEDED.
            list(stack.client.generate([1, 2, 3], max_tokens=4, temperature=0.0, timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert "Redis" in err.value.details()
        # Past the worker registry's cache too (admission reads it first; that read once ended
        # as INTERNAL): UNAVAILABLE again.
        time.sleep(REFRESH_S + 0.1)
        with pytest.raises(grpc.RpcError) as err:
            list(stack.client.generate([1, 2, 3], max_tokens=4, temperature=0.0, timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in err.value.details(), \
            (err.value.code(), err.value.details())
        wait_until(lambda: gateway_health(stack) == NOT_SERVING, 15, "the gateway to report NOT_SERVING")
    finally:
        stack.redis.restart()
    wait_until(lambda: gateway_health(stack) == SERVING, 30, "the gateway to recover")
    streams = run_streams(stack, "after-redis", mixed_prompts(2, seed=21, lo=3, hi=20), max_tokens=8)
    join_all(streams, timeout_s=60)
    assert_all_match(streams, reference)
    wait_pages_at_baseline(stack, baseline)


def test_queued_requests_survive_a_redis_restart(stack, reference):
    baseline = stack.free_pages()
    streams = run_streams(stack, "survivor", mixed_prompts(6, seed=22, lo=56, hi=60), max_tokens=24)
    # Every request admitted (a kill before its admission would refuse it), some still queued.
    redis = stack.redis.client()
    wait_until(lambda: all(redis.exists(f"{{ss}}:req:{s.request_id}") for s in streams), 60,
               "every request to be admitted")
    wait_until(lambda: len(queued_request_ids(stack.redis)["pending"]) >= 3, 60, "requests to queue up")
    stack.redis.kill()
    time.sleep(1.0)  # requests in flight keep going; the queue is out of reach meanwhile
    stack.redis.restart()
    join_all(streams, timeout_s=120)
    assert_all_match(streams, reference)
    wait_pages_at_baseline(stack, baseline)
    # Ends that Redis could not take while it was down are written by the gateway's watchdog
    # (every second) once it is back.
    wait_until(lambda: queued_request_ids(stack.redis) == {"pending": [], "inflight": []}
               and live_request_keys(stack.redis) == [], 10, "every end recorded in Redis")


def test_a_burst_past_the_limit_admits_exactly_the_limit(stack, reference):
    """A gateway with --queue-limit 4 and its decode worker frozen (nothing can finish): of a
    burst of 12 exactly 4 are admitted, the rest get RESOURCE_EXHAUSTED with a retry hint."""
    gateway, address = start_process([*stack.argv["gateway"], "--queue-limit", "4"],
                                     stack.log_dir / "gateway-limit-4.log")
    client = Client(address)
    decode = stack.procs["decode"]
    try:
        wait_until(lambda: len(client.server_info().workers) == 1 + len(stack.roles), 30,
                   "the second gateway to see every worker")
        with frozen(decode):
            streams = run_streams(stack, "burst", mixed_prompts(12, seed=23, lo=3, hi=20), max_tokens=8,
                                  client=client)
            wait_until(lambda: sum(s.code == grpc.StatusCode.RESOURCE_EXHAUSTED for s in streams) == 8, 30,
                       "8 refusals")
        join_all(streams, timeout_s=60)
        refused = [s for s in streams if s.code is not None]
        assert len(refused) == 8
        assert all(s.code == grpc.StatusCode.RESOURCE_EXHAUSTED and s.retry_after_ms for s in refused)
        assert_all_match([s for s in streams if s.code is None], reference)
    finally:
        client.close()
        stop_process(gateway, stack.log_dir / "gateway-limit-4.log")
