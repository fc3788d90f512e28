"""An ended request's Abort reaches a busy worker.

The gateway waits ABORT_TIMEOUT_S for the aborts of a failed attempt (a frozen worker must not
hold up the client's answer or the retry). A worker merely busy for longer than that used to
lose the Abort with the call, and kept the request's pages until the lease ended (a CI cancel
storm ended 5 pages short). An ended request's abort that timed out is sent again in the
background, with a longer bound; a retried one's is not (the retry may reserve there again).
And a request that ends as its attempt's aborts go out (the client's deadline passing as the
worker call it capped did) does not call them back.
Real Redis and real gRPC servers; the worker is a stand-in inside this test of the Dispatcher.
"""
import asyncio
import time

import grpc

from splitserve.engine.sampling_params import SamplingParams
from splitserve.gateway import attempt
from splitserve.gateway.dispatch import Dispatcher
from splitserve.gateway.job import Finished, deadline_exceeded
from splitserve.gateway.workers import WorkerDirectory
from splitserve.state.store import RedisState, make_async_client
from splitserve.v1 import worker_pb2, worker_pb2_grpc
from tests.harness.redis_server import RedisServer
from tests.harness.stand_ins import serve_decode_worker, stop_dispatcher
from tests.harness.streams import until

SHORT_S = 0.2  # the waited-for abort's bound in this test
BUSY_S = 0.6   # how long this worker takes to answer an Abort: longer than SHORT_S


class BusyWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """A colocated worker that refuses every request and is slow to answer an Abort."""

    def __init__(self):
        self.aborts_started = 0
        self.aborts_answered = 0

    async def Decode(self, request, context):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no such thing")
        yield worker_pb2.DecodeChunk()

    async def Abort(self, request, context):
        self.aborts_started += 1
        await asyncio.sleep(BUSY_S)
        self.aborts_answered += 1
        return worker_pb2.WorkerAbortResponse(found=True)


def run_one_request(worker, deadline_s: float | None, then) -> None:
    """Serve ``worker`` (registered as a colocated worker) to a Dispatcher of real Redis, run one
    request through it (``deadline_s`` from now, or none), and await ``then(worker, outcome)``
    with the request's end."""
    async def main(url):
        state = RedisState(make_async_client(url))
        server, address = await serve_decode_worker(worker)
        await state.register_worker("w1", "both", address, [], {}, ttl_s=30)
        dispatcher = Dispatcher(state, WorkerDirectory(state), "g1")
        await dispatcher.start()
        try:
            deadline = None if deadline_s is None else time.monotonic() + deadline_s
            job = dispatcher.new_job("r1", [1, 2, 3], SamplingParams(max_tokens=1), 0, time.time(), deadline)
            assert (await state.admit("r1", "g1", 0, job.arrival_s, {})).admitted
            dispatcher.admitted(job)
            outcome = await asyncio.wait_for(job.events.get(), 10)
            while not isinstance(outcome, Finished):
                outcome = await asyncio.wait_for(job.events.get(), 10)
            await then(worker, outcome)
        finally:
            await stop_dispatcher(dispatcher, state, server)
    with RedisServer() as server:
        asyncio.run(main(server.url))


def test_an_abort_that_timed_out_for_an_ended_request_is_sent_again_and_answered(monkeypatch):
    monkeypatch.setattr(attempt, "ABORT_TIMEOUT_S", SHORT_S)
    monkeypatch.setattr(attempt, "ENDED_ABORT_TIMEOUT_S", 10 * BUSY_S)

    async def then(worker, outcome):
        assert outcome.status == grpc.StatusCode.INVALID_ARGUMENT, outcome
        # The client has its answer without waiting out the busy worker...
        assert worker.aborts_answered == 0
        # ...and the worker still gets an Abort it has time to answer.
        await until(lambda: worker.aborts_answered >= 1, 10, "the re-sent Abort to be answered")
        assert worker.aborts_started == 2 and worker.aborts_answered >= 1
    run_one_request(BusyWorker(), None, then)


class StuckWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """A colocated worker whose Decode never answers."""

    def __init__(self):
        self.aborts = 0

    async def Decode(self, request, context):
        await asyncio.sleep(60)
        yield worker_pb2.DecodeChunk()

    async def Abort(self, request, context):
        self.aborts += 1
        return worker_pb2.WorkerAbortResponse(found=True)


def test_a_request_that_ends_as_its_attempts_aborts_go_out_does_not_call_them_back(monkeypatch):
    sending = attempt._Attempt.abort_on_workers

    async def ended_meanwhile(self, *args, **kwargs):
        # The client's own deadline ends the request just as the aborts start (the Generate
        # handler's Job.finish, at the next turn of the event loop): before any Abort has left.
        asyncio.get_running_loop().call_soon(self.job.finish, deadline_exceeded())
        return await sending(self, *args, **kwargs)
    monkeypatch.setattr(attempt._Attempt, "abort_on_workers", ended_meanwhile)

    async def then(worker, outcome):
        # The Decode call was capped by the request's deadline: it failed with DEADLINE_EXCEEDED,
        # and the attempt's cleanup aborted the request on the worker.
        assert outcome.status == grpc.StatusCode.DEADLINE_EXCEEDED, outcome
        await until(lambda: worker.aborts >= 1, 10, "the Abort to reach the worker (cancelled with the cleanup?)")
        assert worker.aborts == 1, "the Abort was cancelled with the attempt's cleanup, before it left"
    run_one_request(StuckWorker(), 0.5, then)
