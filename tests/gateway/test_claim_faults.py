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
* A request whose client left while Redis admitted it: claimed with no job here, it is recorded
  as its client left (its deadline, or a cancel).
"""
import asyncio
import shutil
import time

import pytest
import redis

from splitserve.common.authz import scoped_id
from splitserve.common.limits import RequestLimits
from splitserve.engine.model_loader import DEFAULT_MODEL, load_tokenizer, resolve_model
from splitserve.engine.sampling_params import SamplingParams
from splitserve.gateway.dispatch import Dispatcher
from splitserve.gateway.job import Finished, Tokens, cancelled, deadline_exceeded
from splitserve.gateway.servicer import GenerationServicer
from splitserve.gateway.workers import WorkerDirectory
from splitserve.state.store import TERMINAL_STATES, RedisState, make_async_client
from splitserve.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
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


async def dispatcher_with_a_worker(url: str, role: str):
    """A Dispatcher ("g1") on Redis at ``url``, one stand-in worker of ``role`` registered."""
    state = RedisState(make_async_client(url))
    worker = StreamingWorker()
    server, address = await serve_decode_worker(worker)
    await state.register_worker("w", role, address, [], {}, ttl_s=60)
    return state, worker, server, Dispatcher(state, WorkerDirectory(state), "g1")


async def terminal_record(state, request_id: str, timeout_s: float = 10) -> dict:
    async with asyncio.timeout(timeout_s):
        while (record := await state.get(request_id))["state"] not in TERMINAL_STATES:
            await asyncio.sleep(0.05)
    return record


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


@pytest.mark.parametrize("how", ["deadline", "client went away"])
def test_a_request_whose_client_left_during_its_admission_is_recorded_as_it_left(how):
    """The client's deadline passed (or it left) while Redis took the request: the handler's
    admission is cancelled before the reply, so the gateway forgets the job, while Redis queues
    it. The claim loop claims it later and finds no job. Its record says how the client left,
    not "aborted: nobody is waiting" (which the cancel storm saw for a deadline request), and no
    worker runs it."""
    async def main(url):
        state, worker, server, dispatcher = await dispatcher_with_a_worker(url, "both")
        try:
            job = dispatcher.new_job("r1", [1, 2, 3], SamplingParams(max_tokens=TOKENS), 0, time.time(), None)
            assert (await state.admit("r1", "g1", 0, job.arrival_s, {})).admitted
            left = deadline_exceeded() if how == "deadline" else cancelled(how)
            dispatcher.forget(job, departed=left)
            await dispatcher.start()
            record = await terminal_record(state, "r1")
            assert (record["state"], record["finish_reason"], record["error"]) == (
                left.terminal_state, left.finish_reason, left.message), record
            assert worker.decodes == 0
            assert not dispatcher._departed  # taken by the claim
        finally:
            await stop_dispatcher(dispatcher, state, server)
    with RedisServer() as server:
        asyncio.run(main(server.url))


def test_a_request_claimed_as_it_was_admitted_whose_client_left_is_recorded_as_it_left():
    """The same, where the admission claims the request in the same call (placements that take
    no capacity): nothing claims it again; its lease lapses, and the watchdog records how the
    client left instead of failing it as a request whose gateway went away."""
    async def main(url):
        state = RedisState(make_async_client(url))
        dispatcher = Dispatcher(state, WorkerDirectory(state), "g1")
        job = dispatcher.new_job("r1", [1, 2, 3], SamplingParams(max_tokens=TOKENS), 0, time.time(), None)
        admitted = await state.admit("r1", "g1", 0, job.arrival_s, {}, claim_lease_s=0.01, now_s=time.time())
        assert admitted.admitted and admitted.claimed == "r1"
        dispatcher.forget(job, departed=deadline_exceeded())
        await asyncio.sleep(0.05)  # the lease lapses
        await dispatcher.watchdog.renew_claims()
        record = await state.get("r1")
        assert (record["state"], record["error"]) == ("deadline", "deadline exceeded"), record
        await state.client.aclose()
    with RedisServer() as server:
        asyncio.run(main(server.url))


def test_the_gateway_forgets_an_admission_its_client_left_as_a_departure():
    """The handler's side of the above, through GenerationServicer.admit: Redis runs the
    admission, whose reply does not come before the client's deadline, and gRPC cancels the
    handler. The claim that follows records the deadline."""
    async def main(url):
        # Decode-only: placements take capacity, so the admission does not claim (the claim loop does).
        state, worker, server, dispatcher = await dispatcher_with_a_worker(url, "decode")
        tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
        info = generation_pb2.ModelInfo(max_model_len=4096, vocab_size=len(tokenizer))
        servicer = GenerationServicer(state, dispatcher, tokenizer, info, RequestLimits().resolve(4096, tokenizer),
                                      grammars=object())
        real_admit, ran = state.admit, asyncio.Event()

        def admit(*args, **kwargs):  # Redis runs it; the reply is slower than the client's deadline
            async def run():
                await real_admit(*args, **kwargs)
                ran.set()
                await asyncio.sleep(3600)
            return run()
        state.admit = admit
        request = generation_pb2.GenerateRequest(token_ids=[1, 2, 3], request_id="r1",
                                            sampling=generation_pb2.SamplingParams(max_tokens=4))
        handler = asyncio.create_task(servicer.admit(request, remaining_s=0.3))
        await asyncio.wait_for(ran.wait(), 10)
        await asyncio.sleep(0.3)
        handler.cancel()  # what gRPC does at the deadline
        with pytest.raises(asyncio.CancelledError):
            await handler
        request_id = scoped_id("", "r1")
        assert request_id not in dispatcher.jobs
        await dispatcher.start()
        try:
            record = await terminal_record(state, request_id)
            assert (record["state"], record["error"]) == ("deadline", "deadline exceeded"), record
            assert worker.decodes == 0
        finally:
            await stop_dispatcher(dispatcher, state, server)
    with RedisServer() as server:
        asyncio.run(main(server.url))
