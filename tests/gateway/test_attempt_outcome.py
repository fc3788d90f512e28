"""What a failed attempt means for its request (``splitserve.gateway.attempt._Attempt.outcome_of``): the
client's DEADLINE_EXCEEDED only once the client's own deadline passed; a worker's timeout, or
a call the gateway capped itself, is a retry; a server's own wait that runs out is UNAVAILABLE
(no process needed: the errors are built by hand)."""
import time

import grpc
import redis

from splitserve.engine.sampling_params import SamplingParams
from splitserve.gateway.attempt import Retry, WorkerLost, _Attempt
from splitserve.gateway.job import Finished, Job, deadline_exceeded
from splitserve.common import errors


def job_with_deadline(deadline: float | None) -> Job:
    return Job("r1", [1, 2, 3], SamplingParams(max_tokens=4), priority=0, arrival_s=0.0, deadline=deadline,
               on_finish=lambda job: None)


def rpc_error(code: grpc.StatusCode, details: str = "from the worker") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def outcome(deadline: float | None, exc: Exception):
    return _Attempt(job_with_deadline(deadline), directory=None, ledger=None).outcome_of(exc)


def test_a_worker_timeout_is_a_retry_while_the_clients_deadline_is_ahead():
    ahead = time.monotonic() + 60
    for deadline in (ahead, None):
        got = outcome(deadline, rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
        assert isinstance(got, Retry) and "DEADLINE_EXCEEDED" in got.reason
        assert isinstance(outcome(deadline, WorkerLost("decode worker d0 failed Reserve")), Retry)
        assert isinstance(outcome(deadline, rpc_error(grpc.StatusCode.UNAVAILABLE)), Retry)


def test_deadline_exceeded_once_the_clients_deadline_passed_whatever_the_worker_said():
    passed = time.monotonic() - 1
    for exc in (rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED), rpc_error(grpc.StatusCode.UNAVAILABLE),
                WorkerLost("the decode stream ended without a finish reason")):
        assert outcome(passed, exc) == deadline_exceeded()


def test_other_worker_errors_end_the_request_with_their_status():
    got = outcome(time.monotonic() + 60, rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "KV layout mismatch"))
    assert got == Finished("error", grpc.StatusCode.FAILED_PRECONDITION, "KV layout mismatch")


def test_a_wait_inside_a_server_that_runs_out_is_unavailable_not_the_callers_deadline():
    for exc in (TimeoutError(), TimeoutError("engine loop busy")):
        code, message = errors.status_for(exc)
        assert code == grpc.StatusCode.UNAVAILABLE and "timed out" in message


def test_redis_unreachable_under_the_placement_is_a_retry_not_an_internal_error():
    """A claimed request whose placement reads the registry as Redis goes away (CI saw INTERNAL
    "gateway error: Error 111 connecting to ..." in test_queued_requests_survive_a_redis_restart)."""
    for exc in (redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:6379."),
                redis.exceptions.TimeoutError("Timeout reading from socket")):
        got = outcome(time.monotonic() + 60, exc)
        assert isinstance(got, Retry) and "Redis" in got.reason and str(exc) in got.reason
