"""splitserve.state.store against a real, private redis-server."""
import threading
import time

import pytest
import redis
from redis.crc import key_slot

from splitserve.state.store import (PRIORITY_MAX, PRIORITY_MIN, AdmitResult, RedisState, make_client,
                                 queue_score)
from tests.harness.redis_server import RedisServer

T0 = 1_750_000_000.0  # Unix seconds; arrival order holds for times after 2020


@pytest.fixture(scope="module")
def server():
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def client(server):
    c = make_client(server.url)
    c.flushall()
    yield c
    c.close()


@pytest.fixture
def state(client):
    st = RedisState(client, queue_limit=8, terminal_ttl_s=60)
    for gateway in ("g1", "g2"):
        st.gateway_beat(gateway, 600)
    return st


def claim_placed(state, gateway="g1", lease_s=30, now=T0):
    """Claim, and at once report the placement decided (as a dispatcher does)."""
    c = state.claim(gateway, lease_s, now)
    if c is not None:
        state.placed(c)
    return c


def admit(state, rid, gateway="g1", priority=0, arrival=T0, **payload):
    return state.admit(rid, gateway, priority, arrival, payload or {"prompt": rid})


# ---- admission


def test_admit_duplicate_full(state):
    r = admit(state, "a", priority=3, max_tokens=5)
    assert r == AdmitResult("admitted", 1, "queued") and r.admitted
    got = state.get("a")
    assert got["state"] == "queued" and got["priority"] == 3 and got["gateway"] == "g1"
    assert got["attempt"] == 0 and got["epoch"] == 0 and got["arrival"] == T0
    assert got["payload"] == {"max_tokens": 5}
    assert "admit_token" not in got

    dup = admit(state, "a", priority=9, max_tokens=99)
    assert dup.status == "duplicate" and dup.state == "queued" and not dup.admitted
    assert state.get("a")["payload"] == {"max_tokens": 5} and state.queue_depth() == 1

    for i in range(7):
        assert admit(state, f"r{i}").admitted
    full = admit(state, "late")
    assert full == AdmitResult("full", 8, None) and full.detail == 8 and dup.detail == "queued"
    assert state.get("late") is None and state.queue_depth() == 8

    # A claimed request still counts against the limit; a duplicate of it reports its state.
    claimed = state.claim("g1", 30, T0)
    assert claimed == "r0"  # priority 0 before a's 3
    assert admit(state, "late").status == "full"
    assert admit(state, "r0") == AdmitResult("duplicate", 8, "dispatching")
    assert state.finish("r0", claimed.epoch, "finished")
    assert admit(state, "late").admitted


def test_an_ended_request_id_is_taken_for_a_while_then_names_a_new_request(client):
    st = RedisState(client, queue_limit=2, terminal_ttl_s=60, id_reuse_after_s=10)
    st.gateway_beat("g1", 600)
    assert admit(st, "a").admitted
    first = claim_placed(st)
    assert admit(st, "a") == AdmitResult("duplicate", 1, "dispatching")  # live
    assert st.finish("a", first.epoch, "finished", finish_reason="length")
    assert admit(st, "a") == AdmitResult("duplicate", 0, "finished")  # ended moments ago
    client.expire(st.request_key("a"), 60 - 10)  # as if 10 s had passed since the end
    # A full queue refuses the new request and leaves the old record as it was.
    assert admit(st, "b").admitted and admit(st, "c").admitted
    assert admit(st, "a").status == "full" and st.get("a")["finish_reason"] == "length"
    assert st.cancel_pending("b") and st.cancel_pending("c")
    assert admit(st, "a", priority=2) == AdmitResult("admitted", 1, "queued")
    got = st.get("a")
    assert (got["state"], got["attempt"], got["epoch"], got["priority"]) == ("queued", 0, first.epoch, 2)
    assert "finish_reason" not in got  # a new record, not merged into the old one
    assert client.ttl(st.request_key("a")) == -1  # live again: no expiry
    # Its claims count on from the old epoch: the old request's late writes stay fenced off.
    second = claim_placed(st)
    assert second == "a" and second.epoch == first.epoch + 1 and second.attempt == 1
    assert not st.update("a", first.epoch, state="decoding")
    assert not st.finish("a", first.epoch, "failed")
    assert st.update("a", second.epoch, state="decoding")


def test_id_reuse_after_must_be_shorter_than_the_record_lives(client):
    with pytest.raises(ValueError, match="id_reuse_after_s"):
        RedisState(client, terminal_ttl_s=60, id_reuse_after_s=60)


def test_a_retried_admit_call_is_not_a_duplicate(state, monkeypatch):
    # redis-py resends a command whose reply was lost; the same call must still read "admitted".
    import splitserve.state.store as rs
    monkeypatch.setattr(rs.uuid, "uuid4", lambda: type("U", (), {"hex": "same-call"})())
    assert admit(state, "a").admitted
    assert admit(state, "a") == AdmitResult("admitted", 1, "queued")
    monkeypatch.undo()
    assert admit(state, "a").status == "duplicate"  # a client retry is a new call


def test_concurrent_burst_admits_exactly_the_limit(client):
    st = RedisState(client, queue_limit=10)
    n = 50
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def one(i):
        barrier.wait(5)
        results[i] = st.admit(f"burst-{i}", f"g{i % 3}", i % 4, T0 + i, {"i": i})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    statuses = [r.status for r in results]
    assert statuses.count("admitted") == 10 and statuses.count("full") == 40
    assert st.queue_depth() == 10
    admitted = {f"burst-{i}" for i, r in enumerate(results) if r.admitted}
    assert {k.removeprefix("{ss}:req:") for k in client.scan_iter("{ss}:req:*")} == admitted


def test_queue_score_without_aging_orders_priority_then_arrival():
    score = lambda p, t: queue_score(p, t, aging_per_s=0)  # noqa: E731
    assert score(0, T0) < score(0, T0 + 0.001) < score(1, T0 - 1e6)
    assert score(-5, T0 + 1e6) < score(0, T0)
    assert score(PRIORITY_MAX, 4e9) <= 2 ** 53 - 1 and score(PRIORITY_MIN, 0) >= -(2 ** 53)
    assert score(2 ** 31 - 1, T0) == score(PRIORITY_MAX, T0)  # clamped
    assert float(score(7, T0 + 0.123)) == score(7, T0 + 0.123)  # exact in a double


def test_queue_score_with_aging_is_the_engine_rule():
    """A priority point is worth 1/aging seconds of waiting: the order splitserve.engine.priority gives."""
    from splitserve.engine.priority import priority_key
    assert queue_score(10, T0, aging_per_s=1.0) < queue_score(0, T0 + 10.5, aging_per_s=1.0)  # waited long enough
    assert queue_score(10, T0, aging_per_s=1.0) > queue_score(0, T0 + 9.5, aging_per_s=1.0)
    assert queue_score(10, T0, aging_per_s=0.5) > queue_score(0, T0 + 10.5, aging_per_s=0.5)  # slower aging
    # (No two virtual arrivals tie here: Redis breaks a tie by request id, the engine by arrival.)
    requests = [(p, T0 + t) for p, t in [(3, 0.0), (0, 2.5), (1, 1.0), (-2, 4.2), (3, 0.5), (0, 3.25)]]
    for aging in (0.0, 0.5, 1.0, 3.0):
        by_score = sorted(requests, key=lambda r: queue_score(*r, aging_per_s=aging))
        by_engine = sorted(requests, key=lambda r: priority_key(r[0], r[1], aging))
        assert by_score == by_engine, aging


# ---- claiming: one global order


def test_claims_follow_one_global_order_across_gateways(client):
    st = RedisState(client, queue_limit=100, priority_aging_per_s=0)
    st.gateway_beat("A", 600)
    st.gateway_beat("B", 600)
    admit(st, "a-low-early", gateway="A", priority=5, arrival=T0)
    admit(st, "a-high", gateway="A", priority=1, arrival=T0 + 5)
    admit(st, "b-urgent", gateway="B", priority=0, arrival=T0 + 10)
    admit(st, "b-low-late", gateway="B", priority=5, arrival=T0 + 20)
    order = []
    for _ in range(10):  # both gateways keep trying; only the head's own gateway gets it
        for gateway in ("A", "B"):
            c = claim_placed(st, gateway)
            if c is not None:
                order.append((gateway, str(c)))
    assert order == [("B", "b-urgent"), ("A", "a-high"), ("A", "a-low-early"), ("B", "b-low-late")]


def test_nobody_claims_while_a_placement_is_open(state):
    admit(state, "x", arrival=T0)
    admit(state, "y", arrival=T0 + 1)
    x = state.claim("g1", 30, T0)
    assert x == "x"
    assert state.claim("g1", 30, T0) is None  # x is being placed: y may not pass it
    assert state.requeue("x", epoch=x.epoch)  # no room: back at the head, the gate opens
    x = state.claim("g1", 30, T0)
    assert x == "x" and x.epoch == 2
    assert state.placed("x")
    assert state.claim("g1", 30, T0) == "y"
    admit(state, "z", arrival=T0 + 2)
    assert state.claim("g1", 30, T0 + 1) is None  # y's placement is open...
    assert state.claim("g1", 30, T0 + 6) == "z"  # ... until its deadline (5 s) passes


def test_without_the_gate_a_claim_takes_consecutive_heads_up_to_another_gateways(state, client):
    for i in range(4):
        admit(state, f"mine{i}", arrival=T0 + i)
    admit(state, "theirs", gateway="g2", arrival=T0 + 10)
    admit(state, "mine-late", arrival=T0 + 20)
    got = state.claim_many("g1", 30, T0, limit=3, gate=False)
    assert got == ["mine0", "mine1", "mine2"] and [c.epoch for c in got] == [1, 1, 1]
    assert client.zcard(state.placing_key) == 0  # no gate held: the next claim goes on at once
    assert state.claim_many("g1", 30, T0, limit=8, gate=False) == ["mine3"]  # stops at g2's head
    assert state.claim_many("g1", 30, T0, limit=8, gate=False) == []
    assert state.claim_many("g2", 30, T0, limit=8, gate=True) == ["theirs"]  # gated: one, gate held
    assert state.claim_many("g1", 30, T0, limit=8, gate=False) == []
    assert state.placed("theirs") and state.claim_many("g1", 30, T0, limit=8, gate=False) == ["mine-late"]


def test_an_admission_at_the_head_claims_its_request_in_the_same_call(state, client):
    """No gate (colocated placements): a request that lands at the head of the queue, with no
    placement open, is claimed by its admission as the next claim would have claimed it; one
    behind another request, or while a placement is open, waits in the queue as usual."""
    first = state.admit("a", "g1", 0, T0, {}, claim_lease_s=30, now_s=T0)
    assert first.admitted and first.claimed == "a" and (first.claimed.epoch, first.claimed.attempt) == (1, 1)
    assert first.state == "dispatching" and state.get("a")["state"] == "dispatching"
    assert client.zscore(state.inflight_key, "a") == T0 + 30 and client.zcard(state.pending_key) == 0
    assert "admit_claim" not in state.get("a")
    # Behind another gateway's queued request (it came first): queued, not claimed.
    admit(state, "theirs", gateway="g2", arrival=T0 + 1)
    second = state.admit("b", "g1", 0, T0 + 2, {}, claim_lease_s=30, now_s=T0)
    assert second == AdmitResult("admitted", 3, "queued") and second.claimed is None
    # A higher priority lands at the head, ahead of both: claimed at once.
    urgent = state.admit("c", "g1", -5, T0 + 3, {}, claim_lease_s=30, now_s=T0)
    assert urgent.claimed == "c"
    assert state.claim_many("g2", 30, T0, limit=8, gate=False) == ["theirs"]
    # A placement open (a gated claim of another gateway): nobody passes it, admissions neither.
    admit(state, "gated", gateway="g2", arrival=T0)
    assert state.claim_many("g2", 30, T0, limit=1, gate=True) == ["gated"]
    blocked = state.admit("d", "g1", -9, T0 + 4, {}, claim_lease_s=30, now_s=T0)
    assert blocked.claimed is None and blocked.state == "queued"
    # Its deadline passed: the gate has lapsed, the admission claims again.
    assert state.admit("e", "g1", -9, T0 + 5, {}, claim_lease_s=30, now_s=T0 + 60).claimed is None  # d is ahead
    assert state.claim_many("g1", 30, T0 + 60, limit=8, gate=False) == ["d", "e", "b"]


def test_a_retried_admission_returns_the_claim_it_made(state, monkeypatch):
    import splitserve.state.store as rs
    monkeypatch.setattr(rs.uuid, "uuid4", lambda: type("U", (), {"hex": "same-call"})())
    first = state.admit("a", "g1", 0, T0, {}, claim_lease_s=30, now_s=T0)
    again = state.admit("a", "g1", 0, T0, {}, claim_lease_s=30, now_s=T0)
    assert again.claimed == "a" and (again.claimed.epoch, again.claimed.attempt) == (1, 1) == \
        (first.claimed.epoch, first.claimed.attempt)
    # A retry of an admission that only queued its request never reports the claim loop's claim
    # as its own (the claim loop runs that one).
    queued = state.admit("b", "g1", 5, T0, {})
    assert queued.claimed is None and state.claim("g1", 30, T0) == "b"
    assert state.admit("b", "g1", 5, T0, {}, claim_lease_s=30, now_s=T0).claimed is None


def test_a_dead_gateways_queued_requests_fail_at_the_head(state, client):
    admit(state, "orphan", gateway="gone", priority=0, arrival=T0)
    admit(state, "mine", gateway="g1", priority=1, arrival=T0)
    with client.pubsub(ignore_subscribe_messages=True) as sub:
        sub.subscribe(state.wake_channel)
        assert claim_placed(state, "g1") == "mine"
        messages, deadline = [], time.monotonic() + 10
        while not {"end orphan", "placed"} <= set(messages) and time.monotonic() < deadline:
            m = sub.get_message(timeout=1.0)
            if m is not None:
                messages.append(m["data"])
    got = state.get("orphan")
    assert got["state"] == "failed" and "gateway" in got["error"] and 0 < client.ttl(state.request_key("orphan"))
    assert "end orphan" in messages and "placed" in messages


def test_a_live_gateways_head_waits_for_it(state):
    admit(state, "theirs", gateway="g2", priority=0, arrival=T0)
    admit(state, "mine", gateway="g1", priority=0, arrival=T0 + 1)
    assert state.claim("g1", 30, T0) is None
    assert state.get("theirs")["state"] == "queued"
    state.gateway_leave("g2")  # it stopped: its request can never be streamed
    assert claim_placed(state, "g1") == "mine" and state.get("theirs")["state"] == "failed"


def test_a_dead_gateways_requests_behind_a_waiting_head_are_failed_and_free_their_room(state):
    admit(state, "head", gateway="g2", priority=0, arrival=T0)  # a live gateway's head that waits for room
    for i in range(6):
        admit(state, f"behind{i}", gateway="g1", priority=0, arrival=T0 + 1 + i)
    admit(state, "last", gateway="g2", priority=0, arrival=T0 + 9)
    assert admit(state, "new", gateway="g2").status == "full"  # the limit is 8
    assert state.fail_orphans() == 0  # g1 is alive: nothing to do
    state.gateway_leave("g1")
    assert state.claim("g2", 30, T0) == "head"  # a claim meets only what is ahead of its head
    assert state.requeue("head")
    assert [state.get(f"behind{i}")["state"] for i in range(6)] == ["queued"] * 6
    assert state.fail_orphans() == 6
    assert state.pending_ids() == ["head", "last"]
    for i in range(6):
        got = state.get(f"behind{i}")
        assert got["state"] == "failed" and got["attempt"] == 0 and "gateway" in got["error"]
    assert state.fail_orphans() == 0
    assert admit(state, "new", gateway="g2").admitted


def test_claim_bumps_attempt_and_epoch_and_requeue_keeps_the_place(state):
    admit(state, "x", priority=2, arrival=T0)
    admit(state, "y", priority=2, arrival=T0 + 1)
    c = claim_placed(state)
    assert c == "x" and (c.epoch, c.attempt) == (1, 1)
    got = state.get("x")
    assert got["state"] == "dispatching" and got["epoch"] == 1 and got["attempt"] == 1
    assert state.queue_depth() == 1

    assert state.requeue("x", epoch=c.epoch)
    assert state.get("x")["state"] == "queued" and state.queue_depth() == 2
    assert state.requeue("x")  # already queued: idempotent
    c2 = claim_placed(state)
    assert c2 == "x" and (c2.epoch, c2.attempt) == (2, 2)  # same score: still ahead of y
    assert not state.requeue("x", epoch=1)  # a stale attempt cannot requeue


def test_claimed_requests_count_against_the_limit_until_they_finish(client):
    st = RedisState(client, queue_limit=2)
    st.gateway_beat("g1", 600)
    assert admit(st, "a").admitted and admit(st, "b").admitted
    a = claim_placed(st)
    assert a == "a" and st.queue_depth() == 1
    assert admit(st, "c").status == "full"  # "a" is running: still unfinished
    assert st.finish("a", a.epoch, "finished")
    assert admit(st, "c").admitted


def test_an_admission_asks_room_for_all_its_samples_and_later_samples_need_none(client):
    """An n > 1 request's first sample asks for n places at once; its later samples, admitted once
    it has its first token, were counted then and are never refused for room -- even when other
    requests took those places meanwhile (the limit is then passed by at most n - 1)."""
    st = RedisState(client, queue_limit=4)
    st.gateway_beat("g1", 600)
    assert admit(st, "a").admitted
    assert st.admit("n4", "g1", 0, T0, {}, room=4).status == "full"  # 1 + 4 > 4
    assert st.admit("n3", "g1", 0, T0, {}, room=3).admitted  # 1 + 3 = 4
    assert admit(st, "b").admitted  # the places are not held: b comes before n3's samples
    assert st.admit("n3/1", "g1", 0, T0, {}, room=0).admitted
    assert st.admit("n3/2", "g1", 0, T0, {}, room=0).admitted
    assert st.queue_depth() == 5
    assert admit(st, "c").status == "full"


def test_claim_scans_a_bounded_window(client):
    st = RedisState(client, queue_limit=100, claim_scan=4)
    st.gateway_beat("g1", 600)
    for i in range(4):
        admit(st, f"stray{i}", gateway="dead", arrival=T0 + i)
    admit(st, "mine", gateway="g1", arrival=T0 + 10)
    assert st.claim("g1", 30, T0) is None  # the window held only a dead gateway's requests...
    assert claim_placed(st, "g1") == "mine"  # ... failed on the way: the next claim sees further
    assert all(st.get(f"stray{i}")["state"] == "failed" for i in range(4))


# ---- fencing, finish, cancel


def test_update_refuses_a_stale_epoch(state):
    admit(state, "x")
    first = claim_placed(state)
    assert state.update("x", first.epoch, state="prefilling", prefill_worker="p1", t_first=T0 + 0.5)
    got = state.get("x")
    assert got["state"] == "prefilling" and got["prefill_worker"] == "p1" and float(got["t_first"]) == T0 + 0.5

    assert state.requeue("x")
    assert not state.update("x", first.epoch, state="decoding")  # queued: nobody owns it
    second = claim_placed(state, now=T0 + 1)
    assert not state.update("x", first.epoch, state="decoding", decode_worker="stale")
    assert not state.extend_lease("x", first.epoch, 30, T0 + 2)
    got = state.get("x")
    assert got["state"] == "dispatching" and "decode_worker" not in got
    assert state.update("x", second.epoch, state="decoding", decode_worker="d1", tokens=[1, 2])
    assert state.get("x")["tokens"] == "[1,2]"
    assert not state.update("nope", 1, error="x")
    with pytest.raises(ValueError):
        state.update("x", second.epoch, state="finished")
    with pytest.raises(ValueError):
        state.update("x", second.epoch, attempt=7)


def test_finish_removes_from_queues_and_expires(state, client):
    admit(state, "q")
    admit(state, "x", arrival=T0 - 1)
    c = state.claim("g1", 30, T0)
    assert c == "x"
    assert not state.finish("x", c.epoch + 1, "finished")  # stale attempt refused
    assert client.zscore(state.placing_key, "x") is not None
    assert state.finish("x", c.epoch, "finished", n_tokens=7, t_done=T0 + 3)
    assert state.finish("x", c.epoch, "finished")  # idempotent
    assert not state.finish("x", None, "failed")  # already terminal in another state
    assert not state.update("x", c.epoch, note="late")
    got = state.get("x")
    assert got["state"] == "finished" and got["n_tokens"] == "7"
    assert client.zscore(state.inflight_key, "x") is None
    assert client.zscore(state.placing_key, "x") is None  # the end also opens the placement gate
    assert 0 < client.ttl(state.request_key("x")) <= 60

    assert state.finish("q", None, "deadline", error="deadline exceeded in queue")
    assert state.queue_depth() == 0 and 0 < client.ttl(state.request_key("q")) <= 60
    assert not state.finish("missing", None, "aborted")
    assert not client.exists(state.request_key("missing"))  # nothing created for an unknown id
    with pytest.raises(ValueError):
        state.finish("q", None, "queued")


def test_cancel_pending(state, client):
    admit(state, "a")
    admit(state, "b", arrival=T0 + 1)
    assert state.cancel_pending("a")
    assert state.cancel_pending("a")  # idempotent
    got = state.get("a")
    assert got["state"] == "aborted" and got["error"] and 0 < client.ttl(state.request_key("a")) <= 60
    assert state.queue_depth() == 1
    assert claim_placed(state) == "b"
    assert not state.cancel_pending("b")  # already dispatched: cancel it on its workers
    assert not state.cancel_pending("missing")


def test_cancel_pending_of_an_owner_leaves_other_owners_requests_alone(state):
    state.admit("mine", "g1", 0, T0, {}, owner="token:aaaa")
    state.admit("legacy", "g1", 0, T0 + 1, {})  # admitted without an owner (security off)
    assert state.get("mine")["owner"] == "token:aaaa"
    assert not state.cancel_pending("mine", owner="token:bbbb")
    assert not state.cancel_pending("mine", owner="")
    assert state.get("mine")["state"] == "queued" and state.queue_depth() == 2
    assert not state.cancel_pending("legacy", owner="token:bbbb")
    assert state.cancel_pending("mine", owner="token:aaaa")
    assert state.cancel_pending("legacy", owner="")  # the anonymous owner of an open gateway
    assert state.queue_depth() == 0
    with pytest.raises(ValueError, match="owned by the queue scripts"):
        state.update("mine", 0, owner="token:bbbb")  # nobody rewrites an owner


def test_inflight_expired_and_reaper_requeue(state):
    for i, rid in enumerate(["a", "b", "c"]):
        admit(state, rid, arrival=T0 + i)
    a = claim_placed(state, lease_s=10)
    b = claim_placed(state, lease_s=20)
    claim_placed(state, lease_s=30)
    assert state.inflight_expired(T0 + 5) == []
    assert state.inflight_expired(T0 + 10) == []  # deadline not passed yet at T0+10
    assert state.inflight_expired(T0 + 15) == ["a"]
    assert state.inflight_expired(T0 + 25) == ["a", "b"]
    assert state.inflight_expired(T0 + 25, limit=1) == ["a"]

    assert state.extend_lease("b", b.epoch, 20, T0 + 15)  # now due at T0+35
    assert state.inflight_expired(T0 + 25) == ["a"]
    assert not state.requeue("b", now_s=T0 + 25)  # lease still valid: the reaper leaves it
    assert state.requeue("a", epoch=a.epoch, now_s=T0 + 25)
    assert state.inflight_expired(T0 + 25) == [] and state.pending_ids() == ["a"]
    assert state.get("a")["state"] == "queued"


# ---- workers


def test_worker_registry(state):
    state.register_worker("d1", "decode", "127.0.0.1:5001", ["shm", "tcp"], {"free_pages": 100}, ttl_s=5)
    state.register_worker("p1", "prefill", "127.0.0.1:5002", ["tcp"], {"load": 0}, ttl_s=0.2)
    ws = state.workers()
    assert [w["worker_id"] for w in ws] == ["d1", "p1"]
    assert ws[0]["role"] == "decode" and ws[0]["transports"] == ["shm", "tcp"]
    assert ws[0]["stats"] == {"free_pages": 100} and ws[0]["updated"] > 0

    assert state.heartbeat("d1", {"free_pages": 42}, ttl_s=5)
    assert state.workers()[0]["stats"] == {"free_pages": 42}

    time.sleep(0.3)  # p1's alive key (200 ms) expires
    assert [w["worker_id"] for w in state.workers()] == ["d1"]
    assert not state.client.sismember(state.workers_key, "p1")
    assert not state.client.exists(state.worker_key("p1"))
    assert not state.heartbeat("p1", {"load": 1}, ttl_s=5)  # presumed dead: must register again
    state.register_worker("p1", "prefill", "127.0.0.1:5002", ["tcp"], {"load": 1}, ttl_s=5)
    assert [w["worker_id"] for w in state.workers()] == ["d1", "p1"]

    state.deregister("d1")
    assert [w["worker_id"] for w in state.workers()] == ["p1"]
    assert not state.heartbeat("d1", {}, ttl_s=5)
    assert state.client.pttl(state.worker_key("p1")) > 0  # the hash never outlives the worker for long


def test_only_records_signed_with_the_registry_key_are_trusted(client):
    """With a registry key (from the internal token) a worker's record is signed at registration
    and on every beat; a record written by anyone without the key -- the store without one,
    another key, or raw writes over a signed record -- is listed as untrusted."""
    key = b"k" * 32
    signed = RedisState(client, registry_key=key)
    signed.register_worker("real", "decode", "127.0.0.1:5001", ["tcp"], {"kv_blocks_free": 10}, ttl_s=5)
    RedisState(client).register_worker("unsigned", "decode", "10.0.0.9:1", ["tcp"], {}, ttl_s=5)
    RedisState(client, registry_key=b"x" * 32).register_worker("wrong-key", "decode", "10.0.0.9:2", [], {}, ttl_s=5)

    def trusted(st):
        return {w["worker_id"]: w["trusted"] for w in st.workers()}
    assert trusted(signed) == {"real": True, "unsigned": False, "wrong-key": False}
    # Without a key nothing is checked (the registry is as trusted as Redis).
    assert trusted(RedisState(client)) == {"real": True, "unsigned": True, "wrong-key": True}

    assert signed.heartbeat("real", {"kv_blocks_free": 3}, ttl_s=5)  # re-signed with the new stats
    real = signed.workers()[0]
    assert (real["worker_id"], real["stats"], real["trusted"]) == ("real", {"kv_blocks_free": 3}, True)
    # Someone with write access to Redis edits the signed record: where prompts go, or the stats.
    client.hset(signed.worker_key("real"), "address", "10.0.0.9:3")
    assert trusted(signed)["real"] is False
    signed.register_worker("real", "decode", "127.0.0.1:5001", ["tcp"], {}, ttl_s=5)
    client.hset(signed.worker_key("real"), "stats", '{"host_id": "elsewhere"}')
    assert trusted(signed)["real"] is False
    # Another worker's signatures do not fit a record of another id.
    signed.register_worker("real", "decode", "127.0.0.1:5001", ["tcp"], {}, ttl_s=5)
    copy = client.hgetall(signed.worker_key("real"))
    client.hset(signed.worker_key("copy"), mapping=copy)
    client.set(signed.alive_key("copy"), "1", px=5000)
    client.sadd(signed.workers_key, "copy")
    assert trusted(signed) == {"copy": False, "real": True, "unsigned": False, "wrong-key": False}


def test_ping(state):
    assert state.ping()


# ---- keys


def test_every_key_carries_the_hash_tag(state, client):
    admit(state, "a")
    admit(state, "b", arrival=T0 + 1)
    admit(state, "c", arrival=T0 + 2)
    c = claim_placed(state)
    state.update("a", c.epoch, state="decoding", decode_worker="d1")
    state.finish("b", None, "aborted")
    state.register_worker("d1", "decode", "h:1", ["tcp"], {}, ttl_s=5)
    keys = list(client.scan_iter("*"))
    assert len(keys) >= 6
    assert all(k.startswith("{ss}:") for k in keys), keys
    assert len({key_slot(k.encode()) for k in keys}) == 1  # one Cluster slot: multi-key scripts work

    other = RedisState(client, prefix="tenant2")
    other.gateway_beat("g1", 60)
    admit(other, "a")
    assert other.get("a") is not None and other.queue_depth() == 1 and state.queue_depth() == 1
    assert all(k.startswith(("{ss}:", "{tenant2}:")) for k in client.scan_iter("*"))
    with pytest.raises(ValueError):
        RedisState(client, prefix="a{b}")


# ---- persistence and failures


def test_append_only_state_survives_restart():
    with RedisServer(appendonly=True) as srv:
        st = RedisState(make_client(srv.url), queue_limit=8, priority_aging_per_s=0)
        st.gateway_beat("g1", 600)
        admit(st, "a", priority=1)
        admit(st, "b", priority=0, arrival=T0 + 1)
        st.register_worker("d1", "decode", "h:1", ["tcp"], {}, ttl_s=60)
        srv.restart()
        assert st.queue_depth() == 2  # the pooled connection reconnects; scripts reload
        assert st.get("a")["payload"] == {"prompt": "a"}
        c = st.claim("g1", 30, T0)
        assert c == "b" and c.epoch == 1
        assert [w["worker_id"] for w in st.workers()] == ["d1"]

        srv.kill()  # a crash: writes already handed to the OS survive
        srv.start()
        fresh = RedisState(make_client(srv.url))
        assert fresh.get("b")["state"] == "dispatching" and fresh.pending_ids() == ["a"]
        assert fresh.claim("g1", 30, T0 + 1) is None  # b's placement gate survived too (until T0 + 5)


def test_errors_propagate_when_redis_is_down():
    with RedisServer(password="s3cret") as srv:
        st = RedisState(make_client(srv.url))
        assert st.ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            make_client(f"redis://127.0.0.1:{srv.port}/0", password="wrong").ping()
        srv.stop()
        t = time.monotonic()
        with pytest.raises(redis.exceptions.ConnectionError):
            admit(st, "a")
        assert time.monotonic() - t < 5
