"""Health that means "can do work", and graceful drain on SIGTERM, with real processes."""
import signal
import subprocess
import time

import grpc
import pytest

from tests.harness.stack import NOT_SERVING, SERVING, gateway_health, health, start_stack, wait_pages_at_baseline
from tests.harness.prompts import mixed_prompts
from tests.harness.streams import assert_all_match, join_all, run_streams, wait_until


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    with start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=2,
                     worker_args=["--drain-timeout-s", "120"], gateway_args=["--drain-timeout-s", "120"]) as st:
        yield st


def wait_or_show(stack, name: str, timeout_s: float) -> int:
    """``name``'s exit code; past ``timeout_s``, a failure with its stacks (SIGUSR1,
    splitserve/common/logs.py) and the end of its log, which says how far its shutdown got."""
    try:
        return stack.procs[name].wait(timeout_s)
    except subprocess.TimeoutExpired:
        stack.procs[name].send_signal(signal.SIGUSR1)
        time.sleep(2)
        pytest.fail(f"{name} still running {timeout_s:.0f} s after SIGTERM:\n"
                    f"{stack.log_paths[name].read_text(errors='replace')[-12000:]}")


def test_gateway_is_not_serving_without_a_usable_set_of_workers(stack, reference):
    assert gateway_health(stack) == SERVING
    stack.kill("prefill")
    try:
        wait_until(lambda: gateway_health(stack) == NOT_SERVING, 20, "NOT_SERVING without a prefill worker")
        with pytest.raises(grpc.RpcError) as err:
            list(stack.client.generate([1, 2, 3], max_tokens=2, temperature=0.0, timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no usable workers" in err.value.details()
    finally:
        stack.restart("prefill")
    wait_until(lambda: gateway_health(stack) == SERVING, 30, "SERVING once the prefill worker is back")


def test_worker_drains_in_flight_requests_on_sigterm(stack, reference):
    baseline = stack.free_pages()
    streams = run_streams(stack, "worker-drain", mixed_prompts(6, seed=31, lo=5, hi=30), max_tokens=300)
    wait_until(lambda: all(len(s.tokens) >= 3 for s in streams), 60, "every stream to be decoding")
    victim = stack.names("decode")[0]
    stack.procs[victim].send_signal(signal.SIGTERM)
    ready = lambda: health(stack.addresses[victim], service="splitserve.v1.DecodeWorker")  # noqa: E731
    wait_until(lambda: ready() != SERVING, 10, f"{victim} to stop reporting ready")
    late = run_streams(stack, "after-sigterm", mixed_prompts(2, seed=32, lo=5, hi=30), max_tokens=8)
    join_all(streams + late)
    assert wait_or_show(stack, victim, 120) == 0
    # A clean exit says nothing at the end: no traceback, and no leak report from an extension
    # whose objects shutdown could not free (the frozen start-up heap is thawed at exit).
    said = stack.log_paths[victim].read_text(errors="replace")
    assert "Traceback" not in said and "leaked" not in said, said[-3000:]
    assert_all_match(streams + late, reference)
    ran_on = lambda s: s.final.timeline.decode_worker.rsplit("-", 1)[0]  # noqa: E731 (ids are <name>-<pid>)
    assert any(ran_on(s) == victim for s in streams), "no request was decoding on the drained worker"
    assert all(s.attempts() == 1 for s in streams)  # finished where they were, not retried elsewhere
    assert all(ran_on(s) != victim for s in late)
    stack.restart(victim)
    wait_pages_at_baseline(stack, {n: baseline[n] for n in baseline if n != victim},
                           names=[n for n in baseline if n != victim])


def test_gateway_drains_on_sigterm(stack, reference):
    """Last in the module: the gateway does not come back."""
    streams = run_streams(stack, "gateway-drain", mixed_prompts(3, seed=33, lo=5, hi=30), max_tokens=300)
    wait_until(lambda: all(len(s.tokens) >= 3 for s in streams), 60, "every stream to be decoding")
    stack.procs["gateway"].send_signal(signal.SIGTERM)
    wait_until(lambda: gateway_health(stack) != SERVING, 10, "the draining gateway to stop reporting SERVING")
    with pytest.raises(grpc.RpcError) as err:
        list(stack.client.generate([1, 2, 3], max_tokens=2, temperature=0.0, timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    join_all(streams)
    assert_all_match(streams, reference)
    assert stack.procs["gateway"].wait(120) == 0
