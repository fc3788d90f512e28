"""Worker faults under load, with real processes: kill -9 and SIGSTOP of prefill and decode
workers mid-request, an engine step that fails, and the retry limit.

Every affected request must either finish with exactly the tokens transformers produces
(nothing lost, nothing repeated after a retry) or end with UNAVAILABLE once its attempts are
spent; pages on every live worker return to their baseline. Every wait is bounded.
"""
import time

import grpc
import pytest

from splitserve.gateway.attempt import SUSPECT_S
from splitserve.client import Client
from splitserve.common.processes import free_port
from tests.harness.prompts import mixed_prompts
from tests.harness.stack import (DEFAULT_WORKER_ARGS, start_process, start_stack, stop_process, wait_pages_at_baseline,
                                      worker_info)
from tests.harness.streams import assert_all_match, busy, frozen, join_all, run_streams, wait_until
from tests.harness.tools import scrape
from splitserve.v1 import worker_pb2, worker_pb2_grpc


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    # Small prefill chunks make a long prompt take many steps: a kill lands mid-transfer.
    with start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=2, decode=2,
                     worker_args=["--max-num-batched-tokens", "16"]) as st:
        yield st


def test_prefill_killed_mid_transfer(stack, reference, baseline):
    prompts = mixed_prompts(10, seed=11, lo=120, hi=200)
    streams = run_streams(stack, "prefill-kill", prompts, max_tokens=6)
    victim = stack.names("prefill")[0]
    wait_until(lambda: busy(stack, victim), 60, f"{victim} to start prefilling")
    stack.kill(victim)
    join_all(streams)
    assert_all_match(streams, reference)
    assert max(s.attempts() for s in streams) >= 2, "the kill hit no request in flight"
    survivors = [n for n in baseline if n != victim]
    wait_pages_at_baseline(stack, {n: baseline[n] for n in survivors}, names=survivors)
    stack.restart(victim)


def retries_counted(stack) -> float:
    return scrape(stack.metrics_ports["gateway"]).get("splitserve:request_retries_total", 0.0)


def test_decode_killed_mid_stream(stack, reference, baseline):
    retries0 = retries_counted(stack)
    prompts = mixed_prompts(8, seed=12, lo=5, hi=40)
    streams = run_streams(stack, "decode-kill", prompts, max_tokens=300)
    wait_until(lambda: all(len(s.tokens) >= 3 for s in streams), 60, "every stream to be decoding")
    victim = stack.names("decode")[0]
    stack.kill(victim)
    join_all(streams)
    assert_all_match(streams, reference)
    retried = sum(s.attempts() - 1 for s in streams)
    assert retried >= 1, "no request was decoding on the killed worker"
    assert retries_counted(stack) - retries0 == retried  # the gateway's metric counts each retry
    survivors = [n for n in baseline if n != victim]
    wait_pages_at_baseline(stack, {n: baseline[n] for n in survivors}, names=survivors)
    stack.restart(victim)


def test_decode_frozen_past_its_lease_then_resumed(stack, reference, baseline):
    """SIGSTOP: the heartbeat stops and the worker ignores the probe, so its requests move on;
    after SIGCONT its late tokens go nowhere (nothing duplicated) and its pages come back."""
    prompts = mixed_prompts(6, seed=13, lo=5, hi=40)
    streams = run_streams(stack, "decode-stop", prompts, max_tokens=400)
    wait_until(lambda: all(len(s.tokens) >= 3 for s in streams), 60, "every stream to be decoding")
    with frozen(stack.procs[stack.names("decode")[1]]):
        join_all(streams)
    assert_all_match(streams, reference)
    assert max(s.attempts() for s in streams) >= 2, "no request was decoding on the frozen worker"
    wait_pages_at_baseline(stack, baseline)  # the resumed worker freed what it held too


def worker_id(stack, name: str) -> str:
    argv = stack.argv[name]
    return argv[argv.index("--worker-id") + 1]


def test_requests_placed_on_a_frozen_decode_worker_move_to_the_healthy_one(stack, reference, baseline):
    """A decode worker frozen just before the requests come is still listed for a moment (its
    heartbeat has not lapsed yet), so a placement asks it to Reserve and gets no answer. That
    costs the request an attempt, as a kill would, and the worker is not picked again: every
    request finishes on the other one, and none gets DEADLINE_EXCEEDED, though each has a
    client deadline (the Reserve's timeout is the gateway's own, not the client's)."""
    victim, healthy = stack.names("decode")[1], stack.names("decode")[0]
    # The test before froze this same worker: until it has registered again and the gateway's
    # suspicion of it (SUSPECT_S from its last failure) has run out, nothing is placed on it, and
    # on a fast machine this test began inside that window.
    wait_until(lambda: worker_id(stack, victim) in {w.worker_id for w in stack.client.server_info().workers}, 30,
               f"{victim} to be registered")
    time.sleep(SUSPECT_S + 1)
    with frozen(stack.procs[victim]):
        streams = run_streams(stack, "reserve-frozen", mixed_prompts(4, seed=18, lo=5, hi=40), max_tokens=40)
        join_all(streams)
        assert_all_match(streams, reference)  # no stream failed, DEADLINE_EXCEEDED included
        assert {s.final.timeline.decode_worker for s in streams} == {worker_id(stack, healthy)}
        assert max(s.attempts() for s in streams) >= 2, "no request was placed on the frozen worker"
    # The thawed worker runs the Reserve it had not read yet, then the attempt's Abort; should
    # they come the other way round, the reservation's lease (30 s) frees the pages.
    wait_pages_at_baseline(stack, baseline, timeout_s=60)


def test_prefill_frozen_mid_transfer_then_resumed(stack, reference, baseline):
    """The frozen prefill worker's requests are prefilled again elsewhere. Once resumed, the
    copies it still had queued hit pages fenced with a newer epoch and are refused (logged as
    "KV transfer of ... refused" when the freeze landed mid-step): requests served after it
    are still exact, so no late write landed in anyone's pages."""
    prompts = mixed_prompts(10, seed=14, lo=150, hi=220)
    victim = stack.names("prefill")[1]
    streams = run_streams(stack, "prefill-stop", prompts, max_tokens=6)
    wait_until(lambda: busy(stack, victim), 60, f"{victim} to start prefilling")
    with frozen(stack.procs[victim]):
        join_all(streams)
    assert_all_match(streams, reference)
    assert max(s.attempts() for s in streams) >= 2, "no request was prefilling on the frozen worker"
    wait_pages_at_baseline(stack, baseline)
    after = run_streams(stack, "after-thaw", mixed_prompts(8, seed=17, lo=5, hi=60), max_tokens=16)
    join_all(after)
    assert_all_match(after, reference)
    wait_pages_at_baseline(stack, baseline)


def test_failed_engine_step_fails_over_and_the_worker_exits_nonzero(stack, reference, baseline, monkeypatch):
    """A worker whose engine step raises answers its requests with UNAVAILABLE (the gateway
    retries them elsewhere), reports NOT_SERVING and exits non-zero for its supervisor."""
    monkeypatch.setenv("SPLITSERVE_FAULT_FAIL_STEP", "40")
    argv = [a if a != stack.argv["decode0"][stack.argv["decode0"].index("--worker-id") + 1] else "faulty-decode"
            for a in stack.argv["decode0"]]
    faulty, _ = start_process(argv, stack.log_dir / "faulty-decode.log")
    monkeypatch.delenv("SPLITSERVE_FAULT_FAIL_STEP")
    try:
        wait_until(lambda: any(w.worker_id == "faulty-decode" for w in stack.client.server_info().workers),
                   30, "the faulty worker to register")
        streams = run_streams(stack, "engine-fault", mixed_prompts(12, seed=15, lo=5, hi=40), max_tokens=60)
        join_all(streams)
        assert faulty.wait(30) == 1
    finally:
        if faulty.poll() is None:
            faulty.kill()
    assert_all_match(streams, reference)
    assert "injected fault" in (stack.log_dir / "faulty-decode.log").read_text()
    assert max(s.attempts() for s in streams) >= 2, "no request ran on the faulty worker"
    wait_pages_at_baseline(stack, baseline)


def test_gives_up_with_unavailable_after_the_retry_limit(stack, reference, baseline):
    """A second gateway on the same workers allows one attempt: the requests that were decoding
    on a killed worker end with UNAVAILABLE and the reason (no hang, no INTERNAL); the rest finish."""
    gateway, address = start_process([*stack.argv["gateway"], "--max-attempts", "1"],
                                     stack.log_dir / "gateway-one-attempt.log")
    client = Client(address)
    try:
        wait_until(lambda: len(client.server_info().workers) == 1 + len(stack.roles), 30,
                   "the second gateway to see every worker")
        streams = run_streams(stack, "limit", mixed_prompts(6, seed=16, lo=5, hi=20), max_tokens=300,
                              client=client)
        wait_until(lambda: all(len(s.tokens) >= 3 for s in streams), 60, "every stream to be decoding")
        victim = stack.names("decode")[0]
        stack.kill(victim)
        join_all(streams)
        failed = [s for s in streams if s.code is not None]
        assert failed, "no request was decoding on the killed worker"
        for s in failed:
            assert s.code == grpc.StatusCode.UNAVAILABLE, (s.request_id, s.code, s.error)
            assert "gave up after 1 attempts" in s.error
            assert s.attempts() == 1
        assert_all_match([s for s in streams if s.code is None], reference)
        survivors = [n for n in baseline if n != victim]
        wait_pages_at_baseline(stack, {n: baseline[n] for n in survivors}, names=survivors)
        stack.restart(victim)
    finally:
        client.close()
        stop_process(gateway, stack.log_dir / "gateway-one-attempt.log")


def test_an_unfilled_reservation_expires_and_is_counted(stack, tmp_path):
    """Pages reserved for a prefill that never comes back are freed at the lease's end, and the
    decode worker's splitserve:kv_lease_expiries counts it."""
    metrics_port = free_port()
    proc, address = start_process(["decode", "--model", stack.model, *DEFAULT_WORKER_ARGS, "--lease-ttl-s", "1",
                                   "--metrics-port", str(metrics_port)], tmp_path / "decode-short-lease.log")
    try:
        stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(address))
        free0 = worker_info(stub).kv_blocks_free
        stub.Reserve(worker_pb2.ReserveRequest(request_id="never-filled", num_prompt_tokens=40), timeout=10)
        assert worker_info(stub).kv_blocks_free == free0 - 5
        wait_until(lambda: worker_info(stub).kv_blocks_free == free0, 30, "the lease to expire")
        assert scrape(metrics_port)["splitserve:kv_lease_expiries_total"] == 1
    finally:
        proc.terminate()
        proc.wait(30)
