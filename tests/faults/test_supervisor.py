"""`splitserve up` supervises: kill -9 of a worker, of the gateway, of Redis, under load.

The survivors keep serving (streams on them finish exactly as transformers would, new requests
succeed at once), and the dead process comes back by itself, registers and takes work.
"""
import os
import signal

import grpc
import pytest
import redis

from tests.harness.prompts import mixed_prompts
from tests.harness.stack import SERVING, health, worker_info
from tests.harness.streams import assert_all_match, join_all, run_streams, wait_until
from tests.harness.up import start_up
from splitserve.common.locality import POOL_PREFIX, pool_root
from splitserve.v1 import generation_pb2


# Given, so that this test can look into up's Redis (up makes one up otherwise).
REDIS_PASSWORD = "supervisor-test"


@pytest.fixture(scope="module")
def up(tiny_model_dirs, tmp_path_factory):
    args = ["--model", str(tiny_model_dirs["llama"]), "--dtype", "float32", "--block-size", "8",
            "--num-gpu-blocks", "256", "--max-num-batched-tokens", "128", "--prefill", "2", "--decode", "2",
            "--num-threads", "1", "--child-log-level", "WARNING", "--redis-password", REDIS_PASSWORD]
    with start_up(args, tmp_path_factory.mktemp("up")) as running:
        yield running


def pools_of(pid: int) -> list:
    """The shm KV pools process ``pid`` made (named by it: splitserve.common.locality)."""
    return list(pool_root().glob(f"{POOL_PREFIX}{pid}-*"))


def decode_workers(up) -> dict[str, str]:
    """worker id -> address of every decode worker the gateway lists."""
    return {w.worker_id: w.address for w in up.client.server_info().workers if w.role == "decode"}


def greedy_ok(up, reference, prompt, max_tokens=8, **kwargs) -> generation_pb2.Final:
    tokens, final = [], None
    for event in up.client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=60,
                                    **kwargs):
        if event.finished:
            final = event
        else:
            tokens += event.token_ids
    assert tokens == reference.greedy(prompt, max_tokens)
    return final


def test_a_killed_decode_worker_is_restarted_while_the_rest_keep_serving(up, reference):
    before = decode_workers(up)
    assert len(before) == 2
    others = {name: pid for name, pid in up.pids.items() if name != "decode0"}
    streams = run_streams(up, "sup-decode", mixed_prompts(8, seed=91, lo=5, hi=40), max_tokens=300, client=up.client)
    wait_until(lambda: all(len(s.tokens) >= 3 for s in streams), 60, "every stream to be decoding")
    victim = up.pids["decode0"]
    assert pools_of(victim), "the decode worker has its KV pool in shared memory"
    os.kill(victim, signal.SIGKILL)
    # At once, before anything came back: a new request succeeds on the survivors.
    greedy_ok(up, reference, mixed_prompts(1, seed=92, lo=10, hi=10)[0])
    join_all(streams)
    assert_all_match(streams, reference)  # every stream, the killed worker's ones retried
    assert max(s.attempts() for s in streams) >= 2, "no stream was decoding on the killed worker"
    line = up.wait_log("decode0 is back")
    assert "exited with code -9" in up.log()
    assert not pools_of(victim), "the killed worker's KV pool was left in shared memory"
    # The rest kept running: the same processes.
    assert {name: up.pids[name] for name in others} == others and up.proc.poll() is None
    wait_until(lambda: len(decode_workers(up)) == 2 and decode_workers(up).keys() != before.keys(), 30,
               "the restarted worker to register")
    [new_id] = decode_workers(up).keys() - before.keys()
    assert new_id in line or decode_workers(up)[new_id] in line
    # ... and takes work: concurrent requests spread over both decode workers.
    took = set()
    for round_ in range(5):
        batch = run_streams(up, f"sup-after-{round_}", mixed_prompts(4, seed=93 + round_, lo=5, hi=20),
                            max_tokens=24, client=up.client)
        join_all(batch)
        assert_all_match(batch, reference)
        took |= {s.final.timeline.decode_worker for s in batch}
        if new_id in took:
            break
    assert new_id in took, f"the restarted decode worker {new_id} served none of the requests ({took})"


def test_a_killed_gateway_is_restarted_on_the_same_port(up, reference):
    streams = run_streams(up, "sup-gateway", mixed_prompts(3, seed=94, lo=5, hi=20), max_tokens=400,
                          client=up.client)
    wait_until(lambda: all(len(s.tokens) >= 3 for s in streams), 60, "every stream to be decoding")
    os.kill(up.pids["gateway"], signal.SIGKILL)
    join_all(streams)
    # Its clients' streams end: the gateway held them.
    assert all(s.code == grpc.StatusCode.UNAVAILABLE for s in streams), [(s.code, s.error) for s in streams]
    up.wait_log("gateway is back")
    wait_until(lambda: health(up.address, service="splitserve.v1.Generation") == SERVING, 60, "the new gateway to serve")
    greedy_ok(up, reference, mixed_prompts(1, seed=95, lo=10, hi=10)[0])
    # The workers freed what the dead gateway's requests held as soon as its calls broke.
    for address in decode_workers(up).values():
        wait_until(lambda: worker_info(address).num_running == 0, 30, f"{address} to drop the orphaned requests")


def request_state(up, request_id: str) -> str:
    return up.client.stub.GetRequest(generation_pb2.GetRequestRequest(request_id=request_id), timeout=10).state


def test_a_killed_redis_is_restarted_with_its_append_only_file_and_the_stack_recovers(up, reference):
    """kill -9 of the redis-server up started: up starts it again on the same port and directory,
    it replays its append-only file (a request that ended before the kill is still on record),
    the workers register again and new requests succeed; up itself never stopped."""
    greedy_ok(up, reference, mixed_prompts(1, seed=97, lo=10, hi=10)[0], request_id="before-redis-kill")
    wait_until(lambda: request_state(up, "before-redis-kill") == "finished", 30, "its end to be recorded")
    store = redis.Redis.from_url(up.redis_url, password=REDIS_PASSWORD, decode_responses=True, socket_timeout=5)
    try:
        assert store.info("persistence")["aof_enabled"] == 1
        # Written to the file (a kill -9 keeps what the process wrote; fsync is for power loss).
        wait_until(lambda: store.info("persistence")["aof_buffer_length"] == 0, 30, "the AOF write")
    finally:
        store.close()
    redis_pid = up.pids["redis"]
    os.kill(redis_pid, signal.SIGKILL)
    up.wait_log("redis is back")  # (the outage itself is too short to catch reliably; see test_redis_faults)
    assert f"redis (pid {redis_pid}) exited with code -9" in up.log()
    wait_until(lambda: health(up.address, service="splitserve.v1.Generation") == SERVING, 60, "the gateway to serve again")
    greedy_ok(up, reference, mixed_prompts(1, seed=96, lo=10, hi=10)[0])
    assert request_state(up, "before-redis-kill") == "finished"  # replayed from the append-only file
    assert up.proc.poll() is None
