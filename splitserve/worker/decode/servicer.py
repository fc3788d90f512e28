"""The DecodeWorker gRPC service over a DecodeConnector (role ``decode``) or a plain engine (role ``both``).

Protocol (the gateway orchestrates): ``Reserve`` returns a transfer descriptor; the prefill
worker writes the prompt's KV into those pages and returns the first token (the gateway calls
``RenewLease`` meanwhile, so a long or queued prefill keeps its pages); ``Decode`` then
completes the handoff with the epoch and streams every later token. ``Decode`` with epoch 0
runs the whole request here, first token included: always on a ``both`` worker, and on a
decode worker for the prompts the gateway does not send to a prefill worker (conditional
disaggregation, splitserve/gateway/prefill_placement.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.outputs import RequestOutput
from splitserve.kvtransfer.decode_side import DecodeConnector
from splitserve.common import tracing
from splitserve.worker.descriptors import descriptor_to_proto
from splitserve.wire import (arrival_to_monotonic, logprobs_from_proto, logprobs_to_proto,
                             sampling_from_worker, structured_output_from_proto)
from splitserve.common.errors import InvalidArgument, ResourceExhausted
from splitserve.common.logs import request_id_var
from splitserve.common.metrics import EngineMetrics
from splitserve.v1 import worker_pb2, worker_pb2_grpc
from splitserve.worker.engine_loop import next_event
from splitserve.worker.servicer import WorkerServicer

log = logging.getLogger(__name__)


class DecodeWorkerServicer(WorkerServicer, worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, engine: LLMEngine, connector: DecodeConnector | None, worker_id: str,
                 metrics: EngineMetrics | None = None, engine_niceness: int = 0, bind_threads: bool = False):
        """``connector`` None: a ``both`` worker that prefills its own requests."""
        self.connector = connector
        self.role = "decode" if connector else "both"
        self.metrics = metrics
        super().__init__(engine, worker_id, connector.transports if connector else [],
                         housekeeping=self._housekeeping, engine_niceness=engine_niceness,
                         bind_threads=bind_threads)

    # ---- on the engine loop thread --------------------------------------------------------
    def step(self):
        before = self.engine.scheduler.num_sampled_tokens
        outputs = self.engine.step()
        if self.metrics is not None:  # with speculative decoding an output may carry several new tokens
            self.metrics.generation_tokens.inc(self.engine.scheduler.num_sampled_tokens - before)
            self.metrics.refresh_counters(self.engine)
        return [(out.request_id, out) for out in outputs]

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def _housekeeping(self) -> None:
        if self.connector is not None:
            expired = self.connector.reap_expired()
            if self.metrics is not None:
                self.metrics.lease_expiries.inc(len(expired))
                self.metrics.pages_set_aside.set(sum(map(len, self.connector.set_aside.values())))
        if self.metrics is not None:
            self.metrics.refresh(self.engine)

    def abort(self, request_id: str) -> bool:
        if self.connector is not None:
            found = self.connector.abort(request_id)
        else:
            found = self.engine.abort_request(request_id) is not None
        # A second abort of the same request (the gateway's Abort after its Decode call was
        # cancelled, or the other way round) finds nothing: that is the normal case.
        log.info("abort of %s: %s", request_id, "its request or pages let go" if found else "nothing held here")
        return found

    def busy(self) -> bool:
        """Running, waiting, or reserved for a handoff still on its way."""
        return self.engine.has_unfinished_requests() or (self.connector is not None and len(self.connector.leases) > 0)

    # ---- RPCs ------------------------------------------------------------------------
    async def Reserve(self, request, context):
        with tracing.server_span("reserve", context, request.request_id, self.worker_id):
            return await self._reserve(request)

    async def _reserve(self, request):
        if self.role == "both":
            raise InvalidArgument("this worker runs prefill and decode itself (role both): call Decode with epoch 0")
        if not request.request_id or request.num_prompt_tokens < 1:
            raise InvalidArgument("request_id and num_prompt_tokens >= 1 are required")
        self.refuse_if_draining()
        prompt = list(request.prompt_token_ids) or None
        if prompt is not None and len(prompt) != request.num_prompt_tokens:
            raise InvalidArgument(f"prompt_token_ids has {len(prompt)} tokens, num_prompt_tokens says "
                                  f"{request.num_prompt_tokens}")
        if request.HasField("structured_output"):  # compiled meanwhile; Decode awaits it
            with contextlib.suppress(ValueError):  # (a malformed spec: Decode says so)
                self.grammars.start(structured_output_from_proto(request.structured_output))
        try:
            # Beside a step's forward, not after the step: the prefill waits for these pages.
            desc = await self.loop.run_during_step(lambda: self.connector.reserve(
                request.request_id, request.num_prompt_tokens, prompt))
        except asyncio.CancelledError:
            # The caller gave up (its client left, its deadline passed) while the pages were being
            # reserved, which is made all the same: nobody will use them, and the caller's Abort
            # may have been handled before it (a cancel storm leaked 4 pages so, until the lease's
            # end). run_during_step raises once the reservation is made: freed after it.
            self.abort_soon(request.request_id)
            raise
        if desc is None:
            raise ResourceExhausted(f"no free KV pages for {request.num_prompt_tokens} tokens on {self.worker_id}",
                                    retry_after_s=0.5)
        return worker_pb2.ReserveResponse(descriptor=descriptor_to_proto(desc), lease_ttl_s=self.connector.leases.ttl_s)

    async def RenewLease(self, request, context):
        if self.role == "both":
            raise InvalidArgument("this worker runs prefill and decode itself (role both): it holds no leases")
        if not request.request_id:
            raise InvalidArgument("request_id is required")
        # On the event loop, not between engine steps: the lease table is thread-safe, and a
        # renewal must not wait for a long step to end.
        ttl_s = self.connector.renew(request.request_id, request.epoch)
        if self.metrics is not None:
            self.metrics.lease_renewals.inc()
        return worker_pb2.RenewLeaseResponse(lease_ttl_s=ttl_s)

    async def Decode(self, request, context):
        with tracing.server_span("decode", context, request.request_id, self.worker_id) as span:
            tokens = 0
            # aclosing: a caller that goes away closes the inner stream now, which aborts the request
            async with contextlib.aclosing(self._decode(request)) as chunks:
                async for chunk in chunks:
                    tokens += len(chunk.token_ids)
                    yield chunk
            span.set_attribute("splitserve.tokens_streamed", tokens)

    async def _decode(self, request):
        rid = request.request_id
        if not rid:
            raise InvalidArgument("request_id is required")
        request_id_var.set(rid)
        params = sampling_from_worker(request.sampling)
        prompt = list(request.prompt_token_ids)
        arrival = arrival_to_monotonic(request.arrival_time)
        log.info("decode of a %d-token prompt (epoch %d)", len(prompt), request.epoch)
        # Before subscribing: a refused spec leaves nothing behind. (On a handoff the pages stay
        # reserved; the gateway's Abort, or the lease's end, frees them.)
        await self.grammars.prepare(params.structured_output)
        events = self.loop.subscribe(rid)
        finished = False
        try:
            if request.epoch == 0:  # prefilled here: a colocated worker, or a decode worker the
                self.refuse_if_draining()  # gateway chose to prefill it (--disaggregation)
                await self.loop.run(lambda: self.engine.add_request(rid, prompt, params, priority=request.priority,
                                                                    arrival_time=arrival))
                if self.metrics is not None:
                    self.metrics.prompt_tokens.inc(len(prompt))
                sent, out = 0, None
            else:
                first_lp = logprobs_from_proto(request.first_logprobs) if request.HasField("first_logprobs") else None
                checksum = request.checksum if request.HasField("checksum") else None
                out = await self.loop.run(lambda: self.connector.complete(
                    rid, request.epoch, prompt, params, request.first_token, checksum=checksum,
                    priority=request.priority, first_logprobs=first_lp, arrival_time=arrival,
                    sampler_state=request.sampler_state or None))
                sent = 1  # the gateway already has the first token from the prefill worker
            while True:
                if out is not None and (len(out.token_ids) > sent or out.finished):
                    chunk = self._chunk(out, sent)
                    if request.epoch == 0 and sent == 0:
                        chunk.cached_prompt_tokens = out.num_cached_tokens
                    sent = len(out.token_ids)
                    finished = out.finished
                    yield chunk
                    if finished:
                        return
                out = await next_event(events)
        except BaseException:
            # The caller went away (this task is cancelled), the engine died, or a call failed:
            # whatever the request holds here goes.
            if not finished:
                self.abort_soon(rid)
            raise
        finally:
            self.loop.unsubscribe(rid)

    # ---- helpers -----------------------------------------------------------------------
    @staticmethod
    def _chunk(out: RequestOutput, sent: int) -> worker_pb2.DecodeChunk:
        chunk = worker_pb2.DecodeChunk(token_ids=out.token_ids[sent:])
        if out.logprobs:
            chunk.logprobs.extend(logprobs_to_proto(lp) for lp in out.logprobs[sent:])
        if out.finished:
            chunk.finish_reason = out.finish_reason
        return chunk

    def close(self) -> None:
        super().close()
        if self.connector is not None:
            self.connector.close()

