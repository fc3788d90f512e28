"""Whom the gateway picks by load and by where KV would move (no processes needed; where prompts' prefixes
are cached: tests/gateway/test_prefix_routing.py)."""
import asyncio

from splitserve.gateway.workers import WorkerDirectory
from splitserve.common.locality import best_transport, default_host_id, transfer_cost


class FakeState:
    """Stands in for the Redis registry inside this unit test of one class."""

    def __init__(self, workers):
        self._workers = workers

    async def workers(self):
        return self._workers


def decode_order(directory):
    return [w.worker_id for w in asyncio.run(directory.decode_candidates())]


def entry(worker_id, role, free=100, running=0):
    return {"worker_id": worker_id, "role": role, "address": f"{worker_id}:1", "transports": [],
            "stats": {"kv_blocks_free": free, "num_running": running}}


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


# ---- where pages live (issue 18 part 2) ----------------------------------------------------

def placed(worker_id, role, host, transports, running=0):
    """A registry entry with a host id; ``transports``: a decode worker's offers, fastest first,
    or what a prefill worker can send over."""
    e = entry(worker_id, role, running=running)
    e["transports"] = list(transports)
    e["stats"]["host_id"] = host
    return e


SENDS = ["shm", "tcp", "nccl", "cuda_ipc"]  # what a prefill worker with --kv-transport auto registers
OFFERS = ["shm", "tcp"]  # a CPU decode worker's auto offer


def pair_of(directory, prompt=(1, 2, 3)):
    """The decode worker placement tries first and the prefill worker chosen for it."""
    decode = asyncio.run(directory.decode_candidates())[0]
    return asyncio.run(directory.pick_prefill(list(prompt), decode)).worker_id, decode.worker_id


def test_best_transport_uses_same_host_transports_only_on_one_host():
    assert best_transport(SENDS, "h1", OFFERS, "h1") == "shm"
    assert best_transport(SENDS, "h1", OFFERS, "h2") == "tcp"
    assert best_transport(SENDS, "", OFFERS, "") == "tcp"  # unknown hosts are not the same host
    assert best_transport(["tcp"], "h1", ["shm"], "h1") is None
    assert best_transport(SENDS, "h1", ["cuda_ipc", "nccl", "tcp"], "h2") == "nccl"
    assert transfer_cost(SENDS, "h1", OFFERS, "h1") < transfer_cost(SENDS, "h1", OFFERS, "h2")


def test_an_idle_stack_pairs_workers_of_one_host():
    """Prefill p_a and decode d_a share host A; d_b is elsewhere. Whatever order the registry
    lists them in, the idle stack's first placement is the shm pair."""
    for order in (1, -1):
        workers = [placed("d_b", "decode", "B", OFFERS), placed("d_a", "decode", "A", OFFERS),
                   placed("p_b", "prefill", "C", SENDS), placed("p_a", "prefill", "A", SENDS)][::order]
        assert pair_of(WorkerDirectory(FakeState(workers))) == ("p_a", "d_a")


def test_the_transfer_cost_yields_to_load():
    """The same-host pair is preferred while it is at most about one request busier; a busier
    one loses to a pair across hosts, so load still spreads."""
    directory = WorkerDirectory(FakeState([placed("d_a", "decode", "A", OFFERS), placed("d_b", "decode", "B", OFFERS),
                                           placed("p_a", "prefill", "A", SENDS)]))
    assert pair_of(directory) == ("p_a", "d_a")
    directory.track("d_a", 2)  # two in flight: the network hop is now the cheaper wait
    assert pair_of(directory) == ("p_a", "d_b")


def test_the_prefill_worker_is_chosen_for_the_decode_worker():
    directory = WorkerDirectory(FakeState([placed("p_a", "prefill", "A", SENDS), placed("p_b", "prefill", "B", SENDS),
                                           placed("d_b", "decode", "B", OFFERS)]))
    assert pair_of(directory) == ("p_b", "d_b")
    directory.track("p_b", 2)  # far busier than the hop from A costs
    assert pair_of(directory) == ("p_a", "d_b")


def test_uniform_costs_keep_the_order_by_load():
    """One host (shm everywhere) or one transport everywhere: the order is the load order of before."""
    for hosts in (("A", "A", "A"), ("A", "B", "C")):
        directory = WorkerDirectory(FakeState([placed("d1", "decode", hosts[0], ["tcp"]),
                                               placed("d2", "decode", hosts[1], ["tcp"]),
                                               placed("p1", "prefill", hosts[2], SENDS)]))
        directory.track("d1", 1)
        assert decode_order(directory) == ["d2", "d1"]


def test_the_default_host_id_names_the_shm_directory(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert default_host_id(tmp_path / "a") == default_host_id(tmp_path / "a")
    assert default_host_id(tmp_path / "a") != default_host_id(tmp_path / "b")
