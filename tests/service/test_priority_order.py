"""One priority order, end to end: free capacity goes to the most urgent request whichever
gateway admitted it, and priorities (not arrival) decide the order requests are served in --
in the Redis queue (disaggregated: capacity is the decode worker's pages) and in an engine's
own queue (colocated: capacity is its batch).

Capacity is held and freed by the test itself: a reservation of every decode page (released
with Abort), or a long request in a one-sequence engine (aborted). While it is held, requests
queue up; once it is freed, they run one at a time, so the order of their first tokens is the
order they were served in. Every stream is also checked token for token against transformers.
"""
import time

import pytest

from splitserve.client import Client
from tests.harness.prompts import mixed_prompts
from tests.harness.stack import queued_request_ids, start_process, start_stack, stop_process, worker_info
from tests.harness.streams import Stream, assert_all_match, join_all, wait_until
from splitserve.v1 import worker_pb2

# 12 pages of 8 tokens: one 56-60-token prompt (8 pages) at a time on the decode worker.
PAGES = 12


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    with start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=1,
                     worker_args=["--num-gpu-blocks", str(PAGES)],
                     role_args={"decode": ["--lease-ttl-s", "600"]}) as st:
        yield st


@pytest.fixture(scope="module")
def reference(llama_reference):
    return llama_reference


class HeldPages:
    """Every page of the decode worker reserved for a request that never comes: nothing fits."""

    def __init__(self, stack, name: str = "decode"):
        self.stub = stack.worker_stub(name)
        self.stub.Reserve(worker_pb2.ReserveRequest(request_id="hold", num_prompt_tokens=PAGES * 8), timeout=10)
        assert worker_info(self.stub).kv_blocks_free == 0

    def release(self) -> None:
        assert self.stub.Abort(worker_pb2.WorkerAbortRequest(request_id="hold"), timeout=10).found


def admitted(stack, request_id: str) -> bool:
    return bool(stack.redis.client().exists(f"{{ss}}:req:{request_id}"))


def submit(stack, client, request_id: str, priority: int, seed: int) -> Stream:
    """Start a request and wait until Redis has it (its arrival is fixed from then on)."""
    stream = Stream(client, request_id, mixed_prompts(1, seed=seed, lo=56, hi=60)[0], 8, priority=priority)
    stream.start()
    wait_until(lambda: admitted(stack, request_id), 30, f"{request_id} to be admitted")
    return stream


def served_order(streams) -> list[str]:
    return [s.request_id for s in sorted(streams, key=lambda s: s.first_token_at)]


def wait_queued_in_order(stack, head: str, ids: list[str]) -> None:
    """Until ``head`` leads the pending queue and every one of ``ids`` waits there (none of them
    mid-placement: whatever is placed next is then decided by the queue alone)."""
    def ready():
        queues = queued_request_ids(stack.redis)
        return queues["pending"][:1] == [head] and set(ids) <= set(queues["pending"])
    wait_until(ready, 30, f"{head} at the head of the queue")


def test_free_capacity_goes_to_a_more_urgent_request_of_another_gateway(stack, reference):
    gateway_b, address_b = start_process([*stack.argv["gateway"]], stack.log_dir / "gateway-b.log")
    client_b = Client(address_b)
    held = HeldPages(stack)
    try:
        # Gateway A queues three low-priority requests first; then B admits an urgent one.
        lows = [submit(stack, stack.client, f"a-low-{i}", priority=20, seed=100 + i) for i in range(3)]
        high = submit(stack, client_b, "b-high", priority=0, seed=110)
        wait_queued_in_order(stack, "b-high", [s.request_id for s in lows])
        held.release()
        join_all(lows + [high])
    finally:
        client_b.close()
        stop_process(gateway_b, stack.log_dir / "gateway-b.log")
    assert_all_match(lows + [high], reference)
    assert served_order(lows + [high]) == ["b-high", "a-low-0", "a-low-1", "a-low-2"]


def test_priorities_decide_the_order_of_the_redis_queue(stack, reference):
    held = HeldPages(stack)
    arrivals = [("p30", 30), ("p10", 10), ("p20", 20), ("p0", 0)]  # arrival order: not the service order
    streams = [submit(stack, stack.client, f"q-{name}", priority, seed=120 + i)
               for i, (name, priority) in enumerate(arrivals)]
    wait_queued_in_order(stack, "q-p0", [s.request_id for s in streams])
    held.release()
    join_all(streams)
    assert_all_match(streams, reference)
    assert served_order(streams) == ["q-p0", "q-p10", "q-p20", "q-p30"]


def test_a_colocated_engine_serves_its_queue_by_priority(tiny_model_dirs, tmp_path_factory, reference):
    """The gateway hands requests to a colocated worker at once; its engine (one sequence at a
    time) orders them by the same rule, with the arrival time the gateway gave them."""
    with start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=0, decode=0, both=1,
                     worker_args=["--max-num-seqs", "1"]) as st:
        both = st.worker_stub("both")
        blocker = Stream(st.client, "e-blocker", [1, 2, 3, 4], 1000)
        blocker.start()
        wait_until(lambda: len(blocker.tokens) > 0, 60, "the blocker to run")
        streams = []
        for i, (name, priority) in enumerate([("p30", 30), ("p10", 10), ("p20", 20), ("p0", 0)]):
            streams.append(submit(st, st.client, f"e-{name}", priority, seed=130 + i))
            wait_until(lambda: worker_info(both).num_waiting == len(streams), 30, "the engine to queue it")
        assert blocker.is_alive(), "the blocker ended before every request waited behind it"
        # Capacity frees: the engine takes its best waiting request, whose first token may come
        # before the abort's answer does (t0 taken after it failed a CI run so).
        t0 = time.monotonic()
        assert st.client.abort("e-blocker")
        join_all(streams + [blocker])
        assert_all_match(streams, reference)
        assert served_order(streams) == ["e-p0", "e-p10", "e-p20", "e-p30"]
        assert all(s.first_token_at > t0 for s in streams)
