"""The public ``splitserve.v1.Generation`` service.

``Generate`` validates and tokenizes, admits the request into the Redis queue in one atomic
step, hands it to the dispatcher and streams what comes back: token ids plus incrementally
detokenized text, cut at stop strings, ``stream_interval`` tokens per message, then one
``final`` message with the finish reason, usage and timeline. A client that goes away or
whose deadline passes aborts the request on every worker.
"""
from __future__ import annotations

import json
import logging
import queue
import time
import uuid

import grpc
import jinja2
import redis
from google.protobuf import json_format

from gateway.detokenizer import IncrementalDetokenizer, StopMatcher
from gateway.dispatch import Dispatcher
from gateway.job import Finished, Job, Tokens
from splitserve.api_convert import prompt_from_request, sampling_from_proto
from splitserve.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from splitserve.logs import request_id_var
from splitserve.metrics import GatewayMetrics
from splitserve.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)

POLL_S = 0.25
NO_DEADLINE_S = 10 * 365 * 86400
RETRY_AFTER_S = 1.0


def _redis_call(fn, *args, **kwargs):
    """Redis down means the service cannot admit or track work: UNAVAILABLE at once, never a hang."""
    try:
        return fn(*args, **kwargs)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
        raise Unavailable(f"request store (Redis) unreachable: {e}") from e


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, state, dispatcher: Dispatcher, tokenizer, model_info: generation_pb2.ModelInfo,
                 metrics: GatewayMetrics | None = None, metrics_address: str = ""):
        self.state = state
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.metrics = metrics
        self.metrics_address = metrics_address
        self.draining = False  # SIGTERM: in-flight requests finish, new ones are refused
        self.health = None  # the GatewayHealth monitor, once the server runs

    # ---- Generate ----------------------------------------------------------------------
    def Generate(self, request, context):
        if self.draining:
            raise Unavailable("the gateway is shutting down; send the request to another one")
        if self.health is not None and self.health.no_workers:
            raise Unavailable(f"this gateway cannot serve now: {self.health.reason}")
        token_ids = self._tokenize(request)
        params = sampling_from_proto(request.sampling)  # validates every field
        if len(token_ids) + 1 > self.model_info.max_model_len:
            raise InvalidArgument(f"prompt has {len(token_ids)} tokens; max_model_len is "
                                  f"{self.model_info.max_model_len}")
        request_id = request.request_id or uuid.uuid4().hex
        request_id_var.set(request_id)
        log.info("admitting %d prompt tokens, priority %d", len(token_ids), request.priority)
        # No client deadline shows up as an infinite (or absurdly far) time remaining.
        remaining = context.time_remaining()
        has_deadline = remaining is not None and remaining < NO_DEADLINE_S
        job = Job(request_id, token_ids, request.sampling, request.priority,
                  deadline=time.monotonic() + remaining if has_deadline else None)
        job.timeline["arrival"] = time.monotonic()
        # Known to the dispatcher before Redis can hand it out: the claim loop may take it the
        # moment it is admitted.
        if not self.dispatcher.submit(job):
            raise InvalidArgument(f"request_id {request_id!r} is already running; a retry with the same id "
                                  "does not run twice — use GetRequest")
        try:
            result = _redis_call(self.state.admit, request_id, self.dispatcher.gateway_id, request.priority,
                                 time.time(), {"prompt_tokens": len(token_ids)})
        except BaseException:
            self.dispatcher.forget(request_id)
            raise
        if not result.admitted:
            self.dispatcher.forget(request_id)
            if result.status == "duplicate":
                raise InvalidArgument(f"request_id {request_id!r} was already submitted (state: {result.detail}); "
                                      "a retry with the same id does not run twice — use GetRequest")
            raise ResourceExhausted(f"queue full ({result.detail} requests unfinished); retry later",
                                    retry_after_s=RETRY_AFTER_S)
        self.dispatcher.wake()
        if not context.add_callback(lambda: self._on_rpc_end(job)):
            self._on_rpc_end(job)  # the RPC already ended: clean up now
            return
        yield from self._stream(job, params, request.stream_interval or 1, context)

    def _stream(self, job: Job, params, interval: int, context):
        detok = IncrementalDetokenizer(self.tokenizer, job.prompt_token_ids)
        stops = StopMatcher(params.stop)
        pending_ids: list[int] = []
        pending_lp: list = []
        pending_text = ""
        completion = 0
        finished: Finished | None = None
        matched = None
        token_times: list[float] = []
        while finished is None:
            event = self._next(job, context)
            if isinstance(event, Tokens):
                now = time.monotonic()
                token_times += [now] * len(event.token_ids)
                completion += len(event.token_ids)
                text, matched = stops.feed(detok.add(event.token_ids))
                pending_ids += event.token_ids
                pending_lp += event.logprobs
                pending_text += text
                if matched is not None:
                    finished = Finished("stop")
                    self.dispatcher.cancel(job.request_id)  # the workers need not go on
                elif len(pending_ids) >= interval:
                    yield self._chunk(pending_ids, pending_text, pending_lp)
                    pending_ids, pending_text, pending_lp = [], "", []
            else:
                finished = event
        if matched is None and finished.status is None:
            pending_text += stops.feed(detok.finish())[0] + stops.flush()
        if pending_ids or pending_text:
            yield self._chunk(pending_ids, pending_text, pending_lp)
        self._record_end(job, finished, completion)
        self._observe(job, finished, token_times)
        if finished.status is not None:
            context.abort(finished.status, finished.message)
        yield self._final(job, finished, matched, completion)

    def _next(self, job: Job, context):
        while True:
            try:
                return job.events.get(timeout=POLL_S)
            except queue.Empty:
                if job.deadline is not None and time.monotonic() > job.deadline:
                    finished = Finished("deadline", grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
                    self.dispatcher.cancel(job.request_id, finished)
                    return finished
                if not context.is_active():
                    if job.deadline_passed():
                        return Finished("deadline", grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
                    return Finished("aborted", grpc.StatusCode.CANCELLED, "client went away")

    def _on_rpc_end(self, job: Job) -> None:
        if not job.recorded:
            # The RPC ended before the handler wrote the request's end: the client went away, its
            # deadline passed, or it left while the last messages were on their way.
            if job.deadline_passed():
                reason, finished = "deadline", Finished("deadline", grpc.StatusCode.DEADLINE_EXCEEDED,
                                                        "deadline exceeded")
            else:
                reason, finished = "aborted", Finished("aborted", grpc.StatusCode.CANCELLED, "client went away")
            # Recorded before the cancel: the handler, woken by the cancel, would record its own.
            # Also takes it out of the queue if it was still waiting.
            self.dispatcher.record_job_end(job, reason, finish_reason=reason)
            self.dispatcher.cancel(job.request_id, finished)
        self.dispatcher.forget(job.request_id)

    def _observe(self, job: Job, finished: Finished, token_times: list[float]) -> None:
        """vLLM's definitions: TTFT, ITL (every gap), TPOT = (e2e - ttft) / (tokens - 1), e2e."""
        m = self.metrics
        if m is None:
            return
        t = job.timeline
        arrival, end = t["arrival"], t.get("finished", time.monotonic())
        m.prompt_tokens.inc(len(job.prompt_token_ids))
        m.generation_tokens.inc(len(token_times))
        m.success.labels(finished_reason=finished.finish_reason).inc()
        m.e2e.observe(end - arrival)
        if "dispatched" in t:
            m.queue.observe(t["dispatched"] - arrival)
        if not token_times:
            return
        ttft = token_times[0] - arrival
        m.ttft.observe(ttft)
        m.prefill.observe(ttft - (t["dispatched"] - arrival if "dispatched" in t else 0.0))
        m.decode.observe(max(0.0, end - token_times[0]))
        for a, b in zip(token_times, token_times[1:]):
            m.itl.observe(b - a)
        if len(token_times) > 1:
            m.tpot.observe((token_times[-1] - token_times[0]) / (len(token_times) - 1))

    def _record_end(self, job: Job, finished: Finished, completion: int) -> None:
        job.timeline.setdefault("finished", time.monotonic())
        terminal = {"length": "finished", "eos": "finished", "stop": "finished", "aborted": "aborted",
                    "deadline": "deadline"}.get(finished.finish_reason, "failed")
        timeline = json_format.MessageToDict(self._timeline(job), preserving_proto_field_name=True)
        self.dispatcher.record_job_end(job, terminal, finish_reason=finished.finish_reason,
                                       error=finished.message, completion_tokens=completion, timeline=timeline)

    # ---- messages ------------------------------------------------------------------------
    @staticmethod
    def _chunk(ids, text, logprobs) -> generation_pb2.GenerateResponse:
        chunk = generation_pb2.Chunk(token_ids=ids, text=text)
        chunk.logprobs.extend(logprobs)
        return generation_pb2.GenerateResponse(chunk=chunk)

    @staticmethod
    def _timeline(job: Job) -> generation_pb2.Timeline:
        t = job.timeline
        ms = lambda a, b: 1000 * (t[b] - t[a]) if a in t and b in t else 0.0  # noqa: E731
        return generation_pb2.Timeline(
            queued_ms=ms("arrival", "dispatched"), prefill_ms=t.get("prefill_ms", 0.0),
            kv_transfer_ms=t.get("kv_transfer_ms", 0.0),
            first_token_ms=ms("arrival", "first_token"), decode_ms=ms("first_token", "finished"),
            prefill_worker=job.prefill_worker.worker_id if job.prefill_worker else "",
            decode_worker=job.decode_worker.worker_id if job.decode_worker else "")

    def _final(self, job: Job, finished: Finished, matched, completion) -> generation_pb2.GenerateResponse:
        timeline = self._timeline(job)
        final = generation_pb2.Final(
            finish_reason=finished.finish_reason, matched_stop=matched or "",
            usage=generation_pb2.Usage(prompt_tokens=len(job.prompt_token_ids), completion_tokens=completion,
                                       cached_prompt_tokens=job.cached_prompt_tokens),
            timeline=timeline, error=finished.message if finished.status else "")
        return generation_pb2.GenerateResponse(final=final)

    # ---- the other RPCs -------------------------------------------------------------------
    def _tokenize(self, request) -> list[int]:
        kind, prompt = prompt_from_request(request, vocab_size=self.model_info.vocab_size)
        if kind == "token_ids":
            return list(prompt)
        if kind == "messages":
            add_prompt = getattr(request, "add_generation_prompt", True) if isinstance(
                request, generation_pb2.TokenizeRequest) else True
            try:
                text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=add_prompt)
            except jinja2.TemplateError as e:  # the model's template refuses this conversation
                raise InvalidArgument(f"messages: the model's chat template refused them: {e}") from e
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def Abort(self, request, context):
        found = self.dispatcher.cancel(request.request_id)
        found = _redis_call(self.state.cancel_pending, request.request_id) or found
        return generation_pb2.AbortResponse(found=found)

    def GetRequest(self, request, context):
        info = _redis_call(self.state.get, request.request_id)
        if info is None:
            raise NotFound(f"no request {request.request_id!r} (finished requests are kept for a while, then expire)")
        timeline = info.get("timeline")
        if isinstance(timeline, str):
            timeline = json.loads(timeline)
        return generation_pb2.RequestInfo(request_id=request.request_id, state=str(info.get("state", "")),
                                          priority=int(info.get("priority", 0)), attempt=int(info.get("attempt", 0)),
                                          finish_reason=str(info.get("finish_reason", "")),
                                          error=str(info.get("error", "")),
                                          timeline=json_format.ParseDict(timeline or {}, generation_pb2.Timeline()))

    def Tokenize(self, request, context):
        ids = self._tokenize(request)
        return generation_pb2.TokenizeResponse(token_ids=ids, tokens=self.tokenizer.convert_ids_to_tokens(ids))

    def GetModelInfo(self, request, context):
        return self.model_info

    def GetServerInfo(self, request, context):
        info = generation_pb2.ServerInfo(queue_depth=_redis_call(self.state.queue_depth))
        if self.metrics is not None:
            self.metrics.queue_depth.set(info.queue_depth)
        info.workers.add(worker_id=self.dispatcher.gateway_id, role="gateway", metrics_address=self.metrics_address)
        for w in self.dispatcher.directory.list():
            info.workers.add(worker_id=w.worker_id, role=w.role, address=w.address, transports=w.transports,
                             kv_blocks_total=w.kv_blocks_total, kv_blocks_free=w.kv_blocks_free,
                             kv_blocks_cached=w.kv_blocks_cached, num_running=w.num_running,
                             num_waiting=w.num_waiting, metrics_address=w.metrics_address)
        return info
