"""The watchdog's check of queued requests against Redis (a real, private redis-server): it ends
what someone else ended there, and leaves alone a request still being admitted."""
import asyncio
import time

import grpc

from splitserve.engine.sampling_params import SamplingParams
from splitserve.gateway.job import Job, JobState
from splitserve.state.store import RedisState, make_async_client
from splitserve.gateway.watchdog import Watchdog
from splitserve.gateway.workers import WorkerDirectory
from tests.harness.redis_server import RedisServer


def test_check_queued_ends_only_what_someone_else_ended():
    async def main(url):
        state = RedisState(make_async_client(url))
        ended = []

        def job(request_id: str, queued: bool) -> Job:
            j = Job(request_id, [1, 2], SamplingParams(), 0, time.time(), None, on_finish=ended.append)
            if queued:
                j.state = JobState.QUEUED
            return j
        admitting = job("admitting", queued=False)  # known to the gateway, its ADMIT not done yet
        queued, aborted, gone = job("queued", True), job("aborted", True), job("gone", True)
        for j in (queued, aborted):
            assert (await state.admit(j.request_id, "g1", 0, time.time(), {})).admitted
        assert await state.cancel_pending("aborted", reason="aborted by id through another gateway")
        # "gone" was queued here but has no record (Redis lost it).
        watchdog = Watchdog(state, WorkerDirectory(state), "g1", lambda: [admitting, queued, aborted, gone])
        await watchdog.check_queued()
        assert admitting.outcome is None and queued.outcome is None
        assert aborted.outcome.status == grpc.StatusCode.CANCELLED
        assert aborted.outcome.message == "aborted by id through another gateway"
        assert gone.outcome.status == grpc.StatusCode.UNAVAILABLE
        assert sorted(j.request_id for j in ended) == ["aborted", "gone"]
        await state.client.aclose()
    with RedisServer() as server:
        asyncio.run(main(server.url))
