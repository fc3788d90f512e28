"""A retried request survives the watchdog's verdict on the worker it just left.

A worker that fails a request and then dies is seen by the watchdog a moment later (gone from
the registry, no answer to a probe). That verdict must not reach the request once its attempt
is over: a cancel that landed in the retry's backoff used to end the attempt task with nobody
putting the request back in the queue, and its client waited forever (a CI run of
tests/faults/test_faults.py hung so). Real Redis and real gRPC servers; the two decode workers
are stand-ins inside this test of the Dispatcher, one failing its stream, one finishing it.
"""
import asyncio
import time

import grpc

from splitserve.engine.sampling_params import SamplingParams
from splitserve.gateway import dispatch
from splitserve.gateway.dispatch import Dispatcher
from splitserve.gateway.job import Finished, JobState
from splitserve.state.store import RedisState, make_async_client
from splitserve.gateway.workers import WorkerDirectory
from tests.harness.redis_server import RedisServer
from tests.harness.stand_ins import serve_decode_worker, stop_dispatcher
from splitserve.v1 import worker_pb2, worker_pb2_grpc


class StandInDecodeWorker(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, fail: bool):
        self.fail = fail
        self.decodes = 0

    async def Decode(self, request, context):
        self.decodes += 1
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine step failed")
        yield worker_pb2.DecodeChunk(token_ids=[7], finish_reason="length")

    async def Abort(self, request, context):
        return worker_pb2.WorkerAbortResponse()


def test_a_retry_in_its_backoff_is_not_cancelled_by_the_watchdogs_verdict_on_the_dead_worker(monkeypatch):
    monkeypatch.setattr(dispatch, "RETRY_BACKOFF_S", 1.0)  # room for the watchdog's round in the backoff

    async def main(url):
        state = RedisState(make_async_client(url))
        failing, good = StandInDecodeWorker(fail=True), StandInDecodeWorker(fail=False)
        failing_server, failing_address = await serve_decode_worker(failing)
        good_server, good_address = await serve_decode_worker(good)
        await state.register_worker("failing", "both", failing_address, [], {}, ttl_s=30)
        retried = asyncio.Event()

        async def failing_worker_dies():
            await failing_server.stop(None)
            await state.deregister("failing")  # its heartbeat lapsed
            await state.register_worker("good", "both", good_address, [], {}, ttl_s=30)
            retried.set()
        dispatcher = Dispatcher(state, WorkerDirectory(state), "g1",
                                on_retry=lambda reason: asyncio.get_running_loop().create_task(failing_worker_dies()))
        await dispatcher.start()
        try:
            job = dispatcher.new_job("r1", [1, 2, 3], SamplingParams(max_tokens=1), 0, time.time(), None)
            assert (await state.admit("r1", "g1", 0, job.arrival_s, {})).admitted
            dispatcher.admitted(job)
            await asyncio.wait_for(retried.wait(), 10)
            assert job.attempt == 1 and not job.finished
            await asyncio.sleep(0.3)  # the directory's cached listing (0.5 s) still shows "failing"
            dispatcher.directory._cached_at = -1.0
            # The watchdog's round, in the backoff: "failing" is gone and does not answer.
            await dispatcher.watchdog.check_workers()
            assert job.lost is None, "the watchdog judged an attempt that was already over"
            outcome = await asyncio.wait_for(job.events.get(), 10)
            while not isinstance(outcome, Finished):
                outcome = await asyncio.wait_for(job.events.get(), 10)
            assert outcome == Finished("length"), outcome
            assert job.attempt == 2 and job.state is JobState.FINISHED
            assert (failing.decodes, good.decodes) == (1, 1)
        finally:
            await stop_dispatcher(dispatcher, state, good_server)
    with RedisServer() as server:
        asyncio.run(main(server.url))
