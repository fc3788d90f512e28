"""The PrefillWorker gRPC service over a PrefillConnector.

``Prefill`` queues the prompt, waits until its KV is in the decode worker's pages (the
connector ships it layer by layer while computing) and answers with the first token and
the epoch the gateway passes on to ``DecodeWorker.Decode``.
"""
from __future__ import annotations

import logging
import queue
import time

from kvtransfer.prefill_side import PrefillConnector, PrefillResult
from splitserve.api_convert import (descriptor_from_proto, logprobs_to_proto, sampling_from_proto,
                                    worker_info_to_proto)
from splitserve.engine_loop import EngineLoop, abort_when_rpc_ends, wait_event
from splitserve.errors import DeadlineExceeded, InvalidArgument, Unavailable
from splitserve.logs import request_id_var
from splitserve.metrics import EngineMetrics, TransferMetrics
from splitserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class PrefillWorkerServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, connector: PrefillConnector, worker_id: str, metrics: EngineMetrics | None = None,
                 transfer_metrics: TransferMetrics | None = None):
        self.connector = connector
        self.engine = connector.engine
        self.worker_id = worker_id
        self.address = ""
        self.metrics = metrics
        self.transfer_metrics = transfer_metrics
        self.draining = False  # SIGTERM: finish what is here, take nothing new
        self.loop = EngineLoop(self._step, connector.has_pending, name="prefill-engine",
                               housekeeping=(lambda: metrics.refresh(self.engine)) if metrics else None).start()

    def _step(self):
        return [(result.request_id, result) for result in self.connector.step()]

    def Prefill(self, request, context):
        rid = request.request_id
        if not rid or not request.prompt_token_ids:
            raise InvalidArgument("request_id and prompt_token_ids are required")
        if not request.HasField("descriptor"):
            raise InvalidArgument("descriptor is required: reserve pages on a decode worker first")
        if self.draining:
            raise Unavailable(f"worker {self.worker_id} is shutting down; it only finishes what it has")
        request_id_var.set(rid)
        desc = descriptor_from_proto(request.descriptor)
        params = sampling_from_proto(request.sampling)
        log.info("prefill of %d tokens into %d pages over %s", len(request.prompt_token_ids),
                 len(desc.block_ids), desc.transport)
        events = self.loop.subscribe(rid)
        done = abort_when_rpc_ends(context, self.loop, lambda: self.connector.abort(rid))
        start = time.monotonic()
        try:
            self.loop.call(lambda: self.connector.start(rid, list(request.prompt_token_ids), params, desc,
                                                        priority=request.priority))
            result = self._wait(events, context, desc.lease_deadline)
            done.set()
            self._record(result, len(request.prompt_token_ids), time.monotonic() - start)
            if result.error is not None:
                raise result.error
            response = worker_pb2.PrefillResponse(
                request_id=rid, epoch=result.epoch, first_token=result.first_token,
                transport=result.transport or "", num_copies=result.num_copies,
                prefill_ms=1000 * (time.monotonic() - start), kv_transfer_ms=1000 * result.transfer_s)
            if result.first_logprobs:
                response.first_logprobs.CopyFrom(logprobs_to_proto(result.first_logprobs))
            if result.checksum is not None:
                response.checksum = result.checksum
            return response
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

    @staticmethod
    def _wait(events: queue.Queue, context, lease_deadline: float) -> PrefillResult:
        # Past the lease (plus a margin) the decode side has freed the pages anyway.
        result = wait_event(events, context, give_up_at=time.monotonic() + max(1.0, lease_deadline - time.time()) + 5)
        if result is None:
            raise DeadlineExceeded("prefill did not finish within the decode worker's lease, or the caller went away")
        return result

    def idle(self) -> bool:
        return self.loop.call(lambda: not self.connector.has_pending(), timeout=10)

    def Abort(self, request, context):
        found = self.loop.call(lambda: self.connector.abort(request.request_id))
        return worker_pb2.WorkerAbortResponse(found=found)

    def GetWorkerInfo(self, request, context):
        return worker_info_to_proto(self.worker_id, "prefill", self.address, sorted(self.connector.sender_factories),
                                    self.loop.call(self.engine.stats))

    def close(self) -> None:
        self.loop.stop()
        self.connector.close()
