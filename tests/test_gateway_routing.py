"""Whom the gateway picks: prefix-cache affinity for prefill, free KV for decode (no processes needed)."""
from gateway.workers import AFFINITY_SLACK, WorkerDirectory


class FakeState:
    """Stands in for the Redis registry inside this unit test of one class."""

    def __init__(self, workers):
        self._workers = workers

    def workers(self):
        return self._workers


def entry(worker_id, role, free=100, running=0):
    return {"worker_id": worker_id, "role": role, "address": f"{worker_id}:1", "transports": [],
            "stats": {"kv_blocks_free": free, "num_running": running}}


def test_prefill_goes_where_the_prefix_is_cached_unless_that_worker_is_much_busier():
    directory = WorkerDirectory(FakeState([entry("p1", "prefill"), entry("p2", "prefill")]), block_size=4)
    system = list(range(100, 140))
    directory.affinity.record(directory.affinity.hashes(system + [1]), "p2")
    assert directory.pick_prefill(system + [7, 8, 9]).worker_id == "p2"
    directory.track("p2", AFFINITY_SLACK)
    assert directory.pick_prefill(system + [7, 8, 9]).worker_id == "p2"
    directory.track("p2", 1)  # now more than the slack busier than p1
    assert directory.pick_prefill(system + [7, 8, 9]).worker_id == "p1"
    # A prompt sharing nothing goes to the least-loaded worker.
    assert directory.pick_prefill([1, 2, 3, 4, 5, 6, 7, 8]).worker_id == "p1"


def test_longest_cached_prefix_wins():
    directory = WorkerDirectory(FakeState([entry("p1", "prefill"), entry("p2", "prefill")]), block_size=4)
    prompt = list(range(200, 232))
    directory.affinity.record(directory.affinity.hashes(prompt[:8]), "p1")
    directory.affinity.record(directory.affinity.hashes(prompt[:24]), "p2")
    assert directory.pick_prefill(prompt).worker_id == "p2"


def test_decode_candidates_most_free_pages_first():
    directory = WorkerDirectory(FakeState([entry("d1", "decode", free=10), entry("d2", "decode", free=50),
                                           entry("b1", "both", free=30), entry("p1", "prefill")]))
    assert [w.worker_id for w in directory.decode_candidates()] == ["d2", "b1", "d1"]


def test_decode_candidates_spread_requests_in_flight_first():
    directory = WorkerDirectory(FakeState([entry("d1", "decode", free=10), entry("d2", "decode", free=50)]))
    directory.track("d2", +1)
    assert [w.worker_id for w in directory.decode_candidates()] == ["d1", "d2"]
    directory.track("d1", +2)
    assert [w.worker_id for w in directory.decode_candidates()] == ["d2", "d1"]
