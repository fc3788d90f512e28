"""A gateway killed with requests still queued: the surviving gateway clears them from the queue.

Real processes: Redis, a decode and a prefill worker, gateway B (the stack's) and gateway A,
both with a queue limit of 8. The decode worker is kept full by one long request of B, and
another request of B that cannot fit waits at the head of the one global queue (strict order:
nothing passes it). Gateway A admits six small requests behind it, which fill the queue, and is
killed with SIGKILL. Nobody can ever stream those six: within A's liveness TTL plus the
survivor's next watchdog round (bounded here by one claim lease, with a margin) they must leave
the queue as failed, never claimed (attempt 0: no Reserve or Prefill was ever sent for them),
their room must be free again for B's new requests, and B must keep serving.
"""
import signal
import threading

import grpc
import pytest

from splitserve.gateway.claim import CLAIM_LEASE_S
from splitserve.state.store import RedisState
from splitserve.client import Client
from tests.harness.stack import start_process, start_stack
from tests.harness.streams import wait_until

QUEUE_LIMIT = 8
# Decode steps slow enough that the long request outlives the test (it is aborted at the end).
STEP_DELAY_S = "0.5"
LONG_PROMPT = list(range(10, 90))  # 10 pages of the decode worker's 32
LONG_TOKENS = 140  # grows to 28 pages: the waiting request's 25 never fit beside it
WAITING_PROMPT = [100 + i % 50 for i in range(200)]
BOOT_S = 120


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    running = start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=1,
                          worker_args=["--num-gpu-blocks", "32"],
                          role_env={"decode": {"SPLITSERVE_FAULT_STEP_DELAY_S": STEP_DELAY_S}},
                          gateway_args=["--queue-limit", str(QUEUE_LIMIT), "--gateway-id", "gw-b"])
    try:
        yield running
    finally:
        running.close()


def stream_in_thread(client, results, key, prompt, **kwargs):
    def run():
        try:
            results[key] = list(client.generate(prompt, temperature=0.0, ignore_eos=True, timeout=600, **kwargs))
        except grpc.RpcError as e:
            results[key] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_killed_gateways_queued_requests_leave_the_queue_and_free_their_room(stack):
    state = RedisState(stack.redis.client())
    results: dict = {}
    stream_in_thread(stack.client, results, "long", LONG_PROMPT, max_tokens=LONG_TOKENS, request_id="long")
    wait_until(lambda: (state.get("long") or {}).get("state") == "decoding", BOOT_S, "the long request to decode")
    stream_in_thread(stack.client, results, "waiting", WAITING_PROMPT, max_tokens=2, request_id="waiting")
    wait_until(lambda: state.get("waiting") is not None, BOOT_S, "the waiting request to be admitted")

    gateway_a, address_a = start_process([*stack.argv["gateway"], "--gateway-id", "gw-a"],
                                         stack.log_dir / "gateway-a.log")
    orphans = [f"orphan-{i}" for i in range(QUEUE_LIMIT - 2)]
    client_a = Client(address_a)
    try:
        for rid in orphans:
            stream_in_thread(client_a, results, rid, [20 + len(rid), 21, 22], max_tokens=2, request_id=rid)
        wait_until(lambda: set(orphans) <= set(state.pending_ids(64)), BOOT_S, "gateway A's requests to be queued")
        # The queue is full: B refuses a new request for now.
        with pytest.raises(grpc.RpcError) as full:
            stack.client.complete([30, 31], max_tokens=1, timeout=30)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        gateway_a.send_signal(signal.SIGKILL)
        gateway_a.wait(20)

        def cleared():
            records = [state.get(rid) for rid in orphans]
            return all(r is not None and r["state"] == "failed" for r in records) and \
                not set(orphans) & set(state.pending_ids(64))
        wait_until(cleared, CLAIM_LEASE_S + 15, "gateway A's queued requests to leave the queue")
    finally:
        client_a.close()

    for rid in orphans:
        record = state.get(rid)
        assert record["attempt"] == 0 and record["gateway"] == "gw-a", record  # never claimed: no worker saw it
        assert "gateway" in record["error"]
    # Their room is back: what is live is B's two requests only, and B admits a new one.
    live = {m for key in (state.pending_key, state.inflight_key) for m in state.client.zrange(key, 0, -1)}
    assert live == {"long", "waiting"}
    assert "long" not in results  # still streaming: the head really was blocked all along
    stream_in_thread(stack.client, results, "after", [40, 41, 42], max_tokens=3, request_id="after")
    wait_until(lambda: (state.get("after") or {}).get("state") is not None, 30, "B to admit a new request")

    # B keeps serving: once the long request goes, the waiting one and the new one finish.
    assert stack.client.abort("long")
    wait_until(lambda: {"waiting", "after"} <= set(results), 120, "B's requests to finish")
    for key in ("waiting", "after"):
        assert not isinstance(results[key], grpc.RpcError), results[key]
        assert results[key][-1].finish_reason == "length"
