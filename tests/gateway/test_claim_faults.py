"""Claims that Redis ran but the gateway never heard of, and claims Redis forgot (issue 36, point 9).

Real Redis and real gRPC; the decode worker is a stand-in inside this test of the Dispatcher
(a colocated worker that streams ``TOKENS`` tokens, one every ``TOKEN_GAP_S``, and counts its
Decode calls).

* A CLAIM whose reply is lost (the connection drops after Redis ran the script): the request is
  claimed in Redis and queued in the gateway. Before, nobody ran it, renewed it or reaped it
  (its own gateway still held it) and its client waited forever; the watchdog now adopts it.
* Redis restarted from an older append-only file (taken while the request was queued) while the
  request runs: Redis queues it again and the claim loop claims it again, under the epoch of the
  attempt already running. Before, a second attempt started (a second Decode, the client's
  tokens streamed twice); the running attempt now keeps the request, under the new epoch, and
  its end is recorded in Redis.
"""
import asyncio
import shutil
import time

import redis

from splitserve.engine.sampling_params import SamplingParams
from splitserve.gateway.dispatch import Dispatcher
from splitserve.gateway.job import Finished, Tokens
from splitserve.gateway.workers import WorkerDirectory
from splitserve.state.store import RedisState, make_async_client
from splitserve.v1 import worker_pb2, worker_pb2_grpc
from tests.harness.redis_server import RedisServer
from tests.harness.stand_ins import serve_decode_worker, stop_dispatcher

TOKENS = 40
TOKEN_GAP_S = 0.1


class StreamingWorker(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self):
        self.decodes = 0
        self.streaming = asyncio.Event()

    async def Decode(self, request, context):
        self.decodes += 1
        for i in range(TOKENS):
            self.streaming.set()
            await asyncio.sleep(TOKEN_GAP_S)
            chunk = worker_pb2.DecodeChunk(token_ids=[i])
            if i == TOKENS - 1:
                chunk.finish_reason = "length"
            yield chunk

    async def Abort(self, request, context):
        return worker_pb2.WorkerAbortResponse()


async def outcome_of(job, timeout_s: float) -> tuple[list[int], Finished]:
    tokens = []
    async with asyncio.timeout(timeout_s):
        while True:
            event = await job.events.get()
            if isinstance(event, Tokens):
                tokens += event.token_ids
            if isinstance(event, Finished):
                return tokens, event


def test_a_claim_whose_reply_is_lost_is_adopted():
    async def main(url):
        state = RedisState(make_async_client(url))
        worker = StreamingWorker()
        server, address = await serve_decode_worker(worker)
        await state.register_worker("w", "both", address, [], {}, ttl_s=60)
        real_claim, lost = state.claim_many, []

        def claim_many(*args, **kwargs):  # Redis runs the claim; the reply never arrives
            async def run():
                claimed = await real_claim(*args, **kwargs)
                if claimed and not lost:
                    lost.extend(claimed)
                    raise redis.exceptions.ConnectionError("Connection reset by peer (the reply was lost)")
                return claimed
            return run()
        state.claim_many = claim_many
        dispatcher = Dispatcher(state, WorkerDirectory(state), "g1")
        await dispatcher.start()
        try:
            job = dispatcher.new_job("r1", [1, 2, 3], SamplingParams(max_tokens=TOKENS), 0, time.time(), None)
            assert (await state.admit("r1", "g1", 0, job.arrival_s, {})).admitted
            dispatcher.admitted(job)
            tokens, outcome = await outcome_of(job, 30)  # it waited forever before
            assert lost == ["r1"]
            assert outcome == Finished("length") and tokens == list(range(TOKENS)) and worker.decodes == 1, (outcome, tokens)
            await dispatcher.ledger.flush(5)
            assert (await state.get("r1"))["state"] == "finished"
        finally:
            await stop_dispatcher(dispatcher, state, server)
    with RedisServer() as server:
        asyncio.run(main(server.url))


def test_a_redis_rolled_back_under_a_running_request_does_not_start_it_twice(tmp_path):
    (tmp_path / "redis").mkdir()
    redis_server = RedisServer(appendonly=True, appendfsync="always", dir=tmp_path / "redis").start()
    older = tmp_path / "older-aof"

    async def main():
        state = RedisState(make_async_client(redis_server.url))
        worker = StreamingWorker()
        server, address = await serve_decode_worker(worker)
        await state.register_worker("w", "both", address, [], {}, ttl_s=600)
        await state.gateway_beat("g1", 600)
        dispatcher = Dispatcher(state, WorkerDirectory(state), "g1")
        try:
            job = dispatcher.new_job("r1", [1, 2, 3], SamplingParams(max_tokens=TOKENS), 0, time.time(), None)
            assert (await state.admit("r1", "g1", 0, job.arrival_s, {})).admitted
            # The append-only file as it stands now, with the request queued (fsync always: every
            # write Redis answered is in it).
            shutil.copytree(redis_server.dir / "appendonlydir", older)
            await dispatcher.start()
            dispatcher.admitted(job)
            await asyncio.wait_for(worker.streaming.wait(), 10)
            await asyncio.sleep(5 * TOKEN_GAP_S)
            # Redis goes down and comes back from the older file: the request is queued again.
            redis_server.kill()
            shutil.rmtree(redis_server.dir / "appendonlydir")
            shutil.copytree(older, redis_server.dir / "appendonlydir")
            redis_server.start()
            tokens, outcome = await outcome_of(job, 30)
            assert worker.decodes == 1, "a second attempt ran the request again"
            assert outcome == Finished("length") and tokens == list(range(TOKENS))
            await dispatcher.ledger.flush(5)
            record = await state.get("r1")
            assert record["state"] == "finished" and record["epoch"] == 1, record
        finally:
            await stop_dispatcher(dispatcher, state, server)
    try:
        asyncio.run(main())
    finally:
        redis_server.close()
