"""Whom the gateway picks: prefix-cache affinity for prefill, free KV for decode (no processes needed)."""
import asyncio

from gateway.workers import AFFINITY_SLACK, WorkerDirectory


class FakeState:
    """Stands in for the Redis registry inside this unit test of one class."""

    def __init__(self, workers):
        self._workers = workers

    async def workers(self):
        return self._workers


def pick_prefill(directory, prompt):
    return asyncio.run(directory.pick_prefill(prompt)).worker_id


def decode_order(directory):
    return [w.worker_id for w in asyncio.run(directory.decode_candidates())]


def entry(worker_id, role, free=100, running=0):
    return {"worker_id": worker_id, "role": role, "address": f"{worker_id}:1", "transports": [],
            "stats": {"kv_blocks_free": free, "num_running": running}}


def test_prefill_goes_where_the_prefix_is_cached_unless_that_worker_is_much_busier():
    directory = WorkerDirectory(FakeState([entry("p1", "prefill"), entry("p2", "prefill")]), block_size=4)
    system = list(range(100, 140))
    directory.affinity.record(directory.affinity.hashes(system + [1]), "p2")
    assert pick_prefill(directory, system + [7, 8, 9]) == "p2"
    directory.track("p2", AFFINITY_SLACK)
    assert pick_prefill(directory, system + [7, 8, 9]) == "p2"
    directory.track("p2", 1)  # now more than the slack busier than p1
    assert pick_prefill(directory, system + [7, 8, 9]) == "p1"
    # A prompt sharing nothing goes to the least-loaded worker.
    assert pick_prefill(directory, [1, 2, 3, 4, 5, 6, 7, 8]) == "p1"


def test_longest_cached_prefix_wins():
    directory = WorkerDirectory(FakeState([entry("p1", "prefill"), entry("p2", "prefill")]), block_size=4)
    prompt = list(range(200, 232))
    directory.affinity.record(directory.affinity.hashes(prompt[:8]), "p1")
    directory.affinity.record(directory.affinity.hashes(prompt[:24]), "p2")
    assert pick_prefill(directory, prompt) == "p2"


def test_decode_candidates_most_free_pages_first():
    directory = WorkerDirectory(FakeState([entry("d1", "decode", free=10), entry("d2", "decode", free=50),
                                           entry("b1", "both", free=30), entry("p1", "prefill")]))
    assert decode_order(directory) == ["d2", "b1", "d1"]


def test_decode_candidates_spread_requests_in_flight_first():
    directory = WorkerDirectory(FakeState([entry("d1", "decode", free=10), entry("d2", "decode", free=50)]))
    directory.track("d2", +1)
    assert decode_order(directory) == ["d1", "d2"]
    directory.track("d1", +2)
    assert decode_order(directory) == ["d2", "d1"]
