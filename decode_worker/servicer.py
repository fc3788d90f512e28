"""The DecodeWorker gRPC service over a DecodeConnector (role ``decode``) or a plain engine (role ``both``).

Protocol (the gateway orchestrates): ``Reserve`` returns a transfer descriptor; the prefill
worker writes the prompt's KV into those pages and returns the first token; ``Decode`` then
completes the handoff with the epoch and streams every later token. On a ``both`` worker,
``Decode`` with epoch 0 runs the whole request here, first token included.
"""
from __future__ import annotations

import logging

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from kvtransfer.decode_side import DecodeConnector
from splitserve.api_convert import (descriptor_to_proto, logprobs_from_proto, logprobs_to_proto,
                                    sampling_from_proto, worker_info_to_proto)
from splitserve.engine_loop import EngineLoop, abort_when_rpc_ends, wait_event
from splitserve.errors import InvalidArgument, ResourceExhausted, Unavailable
from splitserve.logs import request_id_var
from splitserve.metrics import EngineMetrics
from splitserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class DecodeWorkerServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, engine: LLMEngine, connector: DecodeConnector | None, worker_id: str,
                 metrics: EngineMetrics | None = None):
        """``connector`` None: a ``both`` worker that prefills its own requests."""
        self.engine = engine
        self.connector = connector
        self.worker_id = worker_id
        self.role = "decode" if connector else "both"
        self.address = ""
        self.metrics = metrics
        self.draining = False  # SIGTERM: finish what is here, take nothing new
        self.loop = EngineLoop(self._step, self.engine.has_unfinished_requests, housekeeping=self._housekeeping,
                               name=f"{self.role}-engine").start()

    def _step(self):
        outputs = self.engine.step()
        if self.metrics is not None:
            self.metrics.generation_tokens.inc(len(outputs))  # one new token per output
        return [(out.request_id, out) for out in outputs]

    def _housekeeping(self) -> None:
        if self.connector is not None:
            expired = self.connector.reap_expired()
            if expired and self.metrics is not None:
                self.metrics.lease_expiries.inc(len(expired))
        if self.metrics is not None:
            self.metrics.refresh(self.engine)

    # ---- RPCs ------------------------------------------------------------------------
    def Reserve(self, request, context):
        if self.role == "both":
            raise InvalidArgument("this worker runs prefill and decode itself (role both): call Decode with epoch 0")
        if not request.request_id or request.num_prompt_tokens < 1:
            raise InvalidArgument("request_id and num_prompt_tokens >= 1 are required")
        self._refuse_if_draining()
        desc = self.loop.call(lambda: self.connector.reserve(request.request_id, request.num_prompt_tokens))
        if desc is None:
            raise ResourceExhausted(f"no free KV pages for {request.num_prompt_tokens} tokens on {self.worker_id}",
                                    retry_after_s=0.5)
        return worker_pb2.ReserveResponse(descriptor=descriptor_to_proto(desc))

    def Decode(self, request, context):
        rid = request.request_id
        if not rid:
            raise InvalidArgument("request_id is required")
        request_id_var.set(rid)
        params = sampling_from_proto(request.sampling)
        prompt = list(request.prompt_token_ids)
        log.info("decode of a %d-token prompt (epoch %d)", len(request.prompt_token_ids), request.epoch)
        events = self.loop.subscribe(rid)
        done = abort_when_rpc_ends(context, self.loop, lambda: self._abort(rid))
        try:
            if request.epoch == 0:
                if self.role != "both":
                    raise InvalidArgument("epoch is required: this decode worker only continues prefilled requests")
                self._refuse_if_draining()
                self.loop.call(lambda: self.engine.add_request(rid, prompt, params, priority=request.priority))
                if self.metrics is not None:
                    self.metrics.prompt_tokens.inc(len(prompt))
                sent, out = 0, None
            else:
                first_lp = logprobs_from_proto(request.first_logprobs) if request.HasField("first_logprobs") else None
                checksum = request.checksum if request.HasField("checksum") else None
                out = self.loop.call(lambda: self.connector.complete(
                    rid, request.epoch, prompt, params, request.first_token, checksum=checksum,
                    priority=request.priority, first_logprobs=first_lp))
                sent = 1  # the gateway already has the first token from the prefill worker
            while True:
                if out is not None and (len(out.token_ids) > sent or out.finished):
                    chunk = self._chunk(out, sent)
                    sent = len(out.token_ids)
                    if out.finished:
                        done.set()
                        yield chunk
                        return
                    yield chunk
                out = wait_event(events, context)
                if out is None:  # the caller went away; the RPC-end callback aborts the request
                    return
        finally:
            self.loop.unsubscribe(rid)

    def Abort(self, request, context):
        found = self.loop.call(lambda: self._abort(request.request_id))
        return worker_pb2.WorkerAbortResponse(found=bool(found))

    def GetWorkerInfo(self, request, context):
        return worker_info_to_proto(self.worker_id, self.role, self.address,
                                    self.connector.transports if self.connector else [],
                                    self.loop.call(self.engine.stats))

    # ---- draining ----------------------------------------------------------------------
    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise Unavailable(f"worker {self.worker_id} is shutting down; it only finishes what it has")

    def idle(self) -> bool:
        """Nothing running, waiting, or reserved for a handoff still on its way."""
        return self.loop.call(lambda: not self.engine.has_unfinished_requests() and
                              (self.connector is None or len(self.connector.leases) == 0), timeout=10)

    # ---- helpers -----------------------------------------------------------------------
    def _abort(self, request_id: str) -> bool:
        if self.connector is not None:
            return self.connector.abort(request_id)
        return self.engine.abort_request(request_id) is not None

    @staticmethod
    def _chunk(out: RequestOutput, sent: int) -> worker_pb2.DecodeChunk:
        chunk = worker_pb2.DecodeChunk(token_ids=out.token_ids[sent:])
        if out.logprobs:
            chunk.logprobs.extend(logprobs_to_proto(lp) for lp in out.logprobs[sent:])
        if out.finished:
            chunk.finish_reason = out.finish_reason
        return chunk

    def close(self) -> None:
        self.loop.stop()
        if self.connector is not None:
            self.connector.close()

