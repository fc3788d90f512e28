"""The PrefillWorker gRPC service over a PrefillConnector.

``Prefill`` queues the prompt, waits until its KV is in the decode worker's pages (the
connector ships it layer by layer while computing) and answers with the first token and
the epoch the gateway passes on to ``DecodeWorker.Decode``.

How long it waits is the caller's business: the gateway bounds the call and renews the
decode worker's lease meanwhile, however long the prompt waits here or takes to compute. A
handoff nobody drives any more fails at its next write (the decode side freed the pages when
the lease lapsed), and a caller that goes away cancels the prefill.
"""
from __future__ import annotations

import logging
import time

from splitserve.kvtransfer.prefill_side import PrefillConnector, PrefillResult
from splitserve.common import tracing
from splitserve.worker.descriptors import descriptor_from_proto
from splitserve.wire import (arrival_to_monotonic, logprobs_to_proto,
                                    sampling_from_worker)
from splitserve.common.errors import InvalidArgument
from splitserve.common.logs import request_id_var
from splitserve.common.metrics import EngineMetrics, TransferMetrics
from splitserve.v1 import worker_pb2, worker_pb2_grpc
from splitserve.worker.engine_loop import next_event
from splitserve.worker.servicer import WorkerServicer

log = logging.getLogger(__name__)


class PrefillWorkerServicer(WorkerServicer, worker_pb2_grpc.PrefillWorkerServicer):
    role = "prefill"

    def __init__(self, connector: PrefillConnector, worker_id: str, metrics: EngineMetrics | None = None,
                 transfer_metrics: TransferMetrics | None = None, engine_niceness: int = 0,
                 bind_threads: bool = False):
        self.connector = connector
        self.metrics = metrics
        self.transfer_metrics = transfer_metrics
        super().__init__(connector.engine, worker_id, sorted(connector.sender_factories),
                         housekeeping=(lambda: metrics.refresh(self.engine)) if metrics else None,
                         engine_niceness=engine_niceness, bind_threads=bind_threads)

    # ---- on the engine loop thread --------------------------------------------------------
    def step(self):
        return [(result.request_id, result) for result in self.connector.step()]

    def has_work(self) -> bool:
        return self.connector.has_pending()

    def abort(self, request_id: str) -> bool:
        return self.connector.abort(request_id)

    def busy(self) -> bool:
        return self.connector.has_pending()

    # ---- RPCs ------------------------------------------------------------------------
    async def Prefill(self, request, context):
        with tracing.server_span("prefill", context, request.request_id, self.worker_id) as span:
            return await self._prefill(request, span)

    async def _prefill(self, request, span):
        rid = request.request_id
        if not rid or not request.prompt_token_ids:
            raise InvalidArgument("request_id and prompt_token_ids are required")
        if not request.HasField("descriptor"):
            raise InvalidArgument("descriptor is required: reserve pages on a decode worker first")
        self.refuse_if_draining()
        request_id_var.set(rid)
        desc = descriptor_from_proto(request.descriptor)
        params = sampling_from_worker(request.sampling)
        prompt = list(request.prompt_token_ids)
        arrival = arrival_to_monotonic(request.arrival_time)
        log.info("prefill of %d tokens into %d pages over %s", len(prompt), len(desc.block_ids), desc.transport)
        start = time.monotonic()
        await self.grammars.prepare(params.structured_output)
        events = self.loop.subscribe(rid)
        done = False
        try:
            await self.loop.run(lambda: self.connector.start(rid, prompt, params, desc, priority=request.priority,
                                                             arrival_time=arrival))
            result = await next_event(events)
            done = True
            self._record(result, len(prompt), time.monotonic() - start)
            tracing.record_transfer(span, result)  # its bytes are what _record added to the metric
            if result.error is not None:
                raise result.error
            response = worker_pb2.PrefillResponse(
                request_id=rid, epoch=result.epoch, first_token=result.first_token,
                transport=result.transport or "", num_copies=result.num_copies,
                prefill_ms=1000 * (time.monotonic() - start), kv_transfer_ms=1000 * result.transfer_s,
                sampler_state=result.sampler_state or b"", cached_prompt_tokens=result.num_cached_tokens)
            if result.first_logprobs:
                response.first_logprobs.CopyFrom(logprobs_to_proto(result.first_logprobs))
            if result.checksum is not None:
                response.checksum = result.checksum
            return response
        except BaseException:
            if not done:  # the caller went away or gave up: stop computing and sending
                self.abort_soon(rid)
            raise
        finally:
            self.loop.unsubscribe(rid)

    def _record(self, result: PrefillResult, prompt_tokens: int, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(prompt_tokens)
            if result.error is None:
                self.metrics.generation_tokens.inc()  # the first token is sampled here
        if self.transfer_metrics is None:
            return
        transport = result.transport or "none"
        if result.error is not None:
            self.transfer_metrics.failures.labels(transport=transport).inc()
            return
        self.transfer_metrics.bytes.labels(transport=transport).inc(result.bytes_sent)
        self.transfer_metrics.seconds.labels(transport=transport).inc(result.transfer_s)
        self.transfer_metrics.handoff.observe(seconds)

    def close(self) -> None:
        super().close()
        self.connector.close()
