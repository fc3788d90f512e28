"""The public ``splitserve.v1.Generation`` service (asyncio).

``Generate`` validates and tokenizes (the only validation of a request: everything after it
receives resolved parameters), admits the request into the Redis queue in one atomic step and
streams what its ``Job`` yields: token ids plus incrementally detokenized text, cut at stop
strings, ``stream_interval`` tokens per message (more when the client reads slower than tokens
come: ``splitserve/gateway/outbox.py``), then one ``final`` message with the finish reason, usage and
timeline. A client that goes away, or whose deadline passes, ends its job (``Job.finish``), which
aborts the request on every worker; one that stops reading is cut (``splitserve/gateway/backpressure.py``).

Who may touch what (``splitserve.common.authz``): a request belongs to the identity that created it,
and its id is scoped by that identity (``scoped_id``: two identities may use one id at once; a
second request with an id is ``ALREADY_EXISTS`` only for its own identity). Responses carry the
id as the client gave it; Redis, the workers, logs and traces see the scoped one. ``Abort`` and
``GetRequest`` name the caller's own requests, so another identity's are as unknown ids (found
false, NOT_FOUND); the admin may also name any request by its scoped id.
``GetServerInfo`` lists worker and metrics addresses to the admin only; ``GetModelInfo`` names
the model, never a local path.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Mapping

from splitserve.gateway.backpressure import Backpressure
from splitserve.gateway.chat_output.plan import ChatOutputs, OutputPlan
from splitserve.gateway.claim import CLAIM_LEASE_S
from splitserve.gateway.detokenizer import TextStream
from splitserve.gateway.dispatch import Dispatcher
from splitserve.gateway.grammar_check import GrammarChecker
from splitserve.gateway.info_messages import request_info, server_info
from splitserve.gateway.lora_admin import LoRAAdmin
from splitserve.gateway.job import Finished, Job, Tokens, cancelled, deadline_exceeded
from splitserve.gateway.memory import Collector
from splitserve.gateway.prompt_encoder import PromptEncoder
from splitserve.state.store import PRIORITY_MAX, PRIORITY_MIN, TERMINAL_STATES
from splitserve.gateway.samples import MAX_N, SampleGroup, sample_params
from splitserve.wire import check_sizes, resolve_sampling
from splitserve.common.authz import Authorizer, scoped_id
from splitserve.common.errors import (AlreadyExists, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted,
                                      Unavailable)
from splitserve.common.limits import RequestLimits
from splitserve.common.logs import request_id_var
from splitserve.common.metrics import GatewayMetrics
from splitserve.common.tracing import RequestTrace, incoming_context
from splitserve.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)

NO_DEADLINE_S = 10 * 365 * 86400
RETRY_AFTER_S = 1.0


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, state, dispatcher: Dispatcher, tokenizer, model_info: generation_pb2.ModelInfo,
                 limits: RequestLimits, metrics: GatewayMetrics | None = None, metrics_address: str = "",
                 backpressure: Backpressure | None = None, authorizer: Authorizer | None = None,
                 grammars: GrammarChecker | None = None, sampling_defaults: Mapping[str, float | int] | None = None,
                 chat_outputs: ChatOutputs | None = None):
        """``limits``: resolved for this model (``RequestLimits.resolve``); ``backpressure``: the
        bounds on unread output (default ones, not watching for slow readers, if not given);
        ``authorizer``: who callers are (default: no credentials, every caller the anonymous admin);
        ``grammars``: checks structured-output specs in a child process (one is made if not given);
        ``sampling_defaults``: what a request's unset sampling fields take before the server's own
        defaults (the model's ``generation_config.json``: ``splitserve.engine.model_files.sampling_defaults``);
        ``chat_outputs``: the tool-call and reasoning parsers (none: tool_choice auto is refused)."""
        self.authorizer = authorizer or Authorizer()
        self.state = state
        self.dispatcher = dispatcher
        self.ledger = dispatcher.ledger
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.limits = limits
        self.sampling_defaults = dict(sampling_defaults or {})
        self.chat_outputs = chat_outputs or ChatOutputs()
        self.collector = Collector()
        self.metrics = metrics
        self.metrics_address = metrics_address
        self.draining = False  # SIGTERM: in-flight requests finish, new ones are refused
        self.health = None  # the GatewayHealth monitor, once the server runs
        self.backpressure = backpressure or Backpressure()
        self.prompts = PromptEncoder(tokenizer, model_info.vocab_size)
        self.grammars = grammars or GrammarChecker()
        self.loras = LoRAAdmin(dispatcher, self.ledger)
        # The n > 1 requests running here, by id (gone with their last reference).
        self._groups: weakref.WeakValueDictionary[str, SampleGroup] = weakref.WeakValueDictionary()

    # ---- Generate ----------------------------------------------------------------------
    async def Generate(self, request, context):
        caller = self.authorizer.caller(context)
        group = await self.admit(request, context.time_remaining(), owner=caller.owner, admin=caller.admin,
                                 trace_parent=incoming_context(dict(context.invocation_metadata() or ())))
        # However the RPC ends (cancelled, deadline, the stream done), the request has ended by then.
        context.add_done_callback(lambda _: group.finish(self._rpc_gone(group.leader)))
        streams = []
        group.watch(lambda job: streams.append(self.backpressure.open(job, context)))
        try:
            # The headers go now rather than with the first message: a status (a slow reader's
            # cut) cannot be sent beside a pending first send, which carries them.
            streams[0].sending_since = time.monotonic()
            await context.send_initial_metadata(())
            streams[0].sending_since = None
            async for response in self._stream(group, request.stream_interval or 1, context):
                # The yield returns once gRPC took the message: it waits as long as the client's
                # HTTP/2 window is full, which is what the slow-reader timeout measures (on the
                # first sample's stream: a cut of any sample ends the request).
                streams[0].sending_since = time.monotonic()
                yield response
                streams[0].sending_since = None
        except BaseException:
            group.finish(self._rpc_gone(group.leader))  # the client left mid-stream (this task is cancelled)
            raise
        finally:
            for stream in streams:
                self.backpressure.close(stream)

    async def admit(self, request: generation_pb2.GenerateRequest, remaining_s: float | None,
                    owner: str = "", trace_parent=None, admin: bool = False) -> SampleGroup:
        """Validate, tokenize and admit ``request`` (the one path of every API: gRPC and HTTP);
        ``remaining_s``: time left before the client's deadline (None or huge: no deadline);
        ``owner``: the caller's identity (``splitserve.common.authz``), who may read and abort it;
        ``admin``: the caller holds the admin credential (or none is configured): only it may ask
        for a priority below 0, ahead of every default request;
        ``trace_parent``: the trace context the client sent (``splitserve.common.tracing``), if any.
        Returns its samples (one unless ``sampling.n`` > 1: ``splitserve.gateway.samples``). The caller
        streams ``outputs(group)`` and must end the group if its client goes away."""
        trace = RequestTrace(trace_parent)
        try:
            group = await self._admit(request, remaining_s, owner, trace, trace_parent, admin)
        except BaseException as exc:
            trace.refused(exc)
            raise
        trace.admitted()
        return group

    async def _admit(self, request, remaining_s: float | None, owner: str, trace: RequestTrace,
                     trace_parent, admin: bool) -> SampleGroup:
        if self.draining:
            raise Unavailable("the gateway is shutting down; send the request to another one")
        self._check_sizes(request)
        if self.health is not None and self.health.no_workers:
            raise Unavailable(f"this gateway cannot serve now: {self.health.reason}")
        self.backpressure.check_room()
        plan = self.chat_outputs.plan(request, self.limits)
        token_ids = await self.prompts.token_ids(request)
        params = resolve_sampling(request.sampling, len(token_ids), self.model_info.max_model_len,
                                  self.sampling_defaults)
        params.lora = await self._lora(request.lora)
        plan = self.chat_outputs.with_prompt(plan, token_ids)
        if params.structured_output is not None:
            # The thinking is free text; the constraint starts after it (splitserve.engine.grammar).
            params.structured_output = self.chat_outputs.after_reasoning(plan, params.structured_output)
        if params.structured_output is not None:
            await self.grammars.check(params.structured_output)
        n = request.sampling.n if request.sampling.HasField("n") else 1
        if not 1 <= n <= MAX_N:
            raise InvalidArgument(f"sampling.n must be in [1, {MAX_N}], got {n}")
        if not PRIORITY_MIN <= request.priority <= PRIORITY_MAX:
            raise InvalidArgument(f"priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {request.priority}")
        if request.priority < 0 and not admin:
            raise PermissionDenied(f"priority {request.priority}: a priority below 0 goes ahead of every default "
                                   "request and needs the admin token (--admin-token); clients may use 0 and above")
        client_id = request.request_id or uuid.uuid4().hex
        request_id = scoped_id(owner, client_id)  # what Redis, the jobs and the workers know it by
        request_id_var.set(request_id)
        log.info("admitting %d prompt tokens, priority %d%s", len(token_ids), request.priority,
                 f", {n} samples" if n > 1 else "")
        # No client deadline shows up as an infinite (or absurdly far) time remaining.
        has_deadline = remaining_s is not None and remaining_s < NO_DEADLINE_S
        deadline = time.monotonic() + remaining_s if has_deadline else None
        admission = _Admission(token_ids, request.priority, time.time(), deadline, owner, plan)
        leader = await self._admit_job(admission, request_id, params, trace, room=n, shown_id=client_id)

        async def admit_sample(index: int, prefer_decode: str | None) -> Job:
            sample_trace = RequestTrace(trace_parent)  # each sample's own request span
            try:
                if self.draining:
                    raise Unavailable("the gateway is shutting down; send the request to another one")
                job = await self._admit_job(admission, f"{request_id}/{index}", sample_params(params, index),
                                            sample_trace, room=0, prefer_decode=prefer_decode,
                                            shown_id=f"{client_id}/{index}")
            except BaseException as exc:
                sample_trace.refused(exc)
                raise
            sample_trace.admitted()
            return job
        group = SampleGroup(leader, n, admit_sample, request_id=client_id)
        if n > 1:
            self._groups[request_id] = group  # Abort of the request's id ends every sample
        return group

    async def _admit_job(self, admission: "_Admission", request_id: str, params, trace: RequestTrace, room: int,
                         prefer_decode: str | None = None, shown_id: str = "") -> Job:
        """One job into the Redis queue; ``room``: the queue places it needs (``state.admit``);
        ``request_id``: the scoped id, ``shown_id``: the id as the client named it (its errors say that)."""
        job = self.dispatcher.new_job(request_id, admission.token_ids, params, admission.priority,
                                      admission.arrival_s, deadline=admission.deadline,
                                      text=TextStream(self.tokenizer, admission.token_ids, params.stop),
                                      owner=admission.owner)
        if job is None:  # this gateway runs it (its record may not even be in Redis yet)
            raise AlreadyExists(_duplicate_message(shown_id, "running", self.state.id_reuse_after_s))
        job.prefer_decode = prefer_decode
        job.chat_output = admission.plan.output()
        job.trace = trace
        trace.identify(request_id, len(admission.token_ids), admission.priority)
        try:
            # Placements that take no capacity: a request landing at the head of the queue is
            # claimed in the same Redis call (the claim loop's round trip saved). Whether they do
            # reads the worker registry: Redis away is UNAVAILABLE here too, and the job goes.
            claim = {"claim_lease_s": CLAIM_LEASE_S, "now_s": time.time()} \
                if await self.ledger.now(self.dispatcher.claim_at_admission()) else {}
            result = await self.ledger.now(self.state.admit(
                request_id, self.dispatcher.gateway_id, admission.priority, admission.arrival_s,
                {"prompt_tokens": len(admission.token_ids)}, admission.owner, room=room, **claim))
        except asyncio.CancelledError:  # the client left, or its deadline passed, while Redis took it
            self.dispatcher.forget(job, departed=self._rpc_gone(job))
            raise
        except BaseException:
            self.dispatcher.forget(job)
            raise
        if not result.admitted:
            self.dispatcher.forget(job)
            if result.status == "duplicate":
                raise AlreadyExists(_duplicate_message(shown_id, result.state, self.state.id_reuse_after_s))
            raise ResourceExhausted(f"queue full ({result.detail} requests unfinished); retry later",
                                    retry_after_s=RETRY_AFTER_S)
        self.dispatcher.admitted(job, result.claimed)
        return job

    async def outputs(self, group: SampleGroup):
        """``(index, event)`` of the request's samples as they come: ``Tokens`` (the last of a
        sample may carry only the text held back for a stop string, or the calls its parser
        found at the end), then the sample's ``Finished``; each sample's metrics are recorded as
        it ends. A failed sample is the last thing that comes (the others are ended)."""
        token_times: dict[int, list[float]] = {}
        observed: set[int] = set()
        try:
            async for index, event in group.events():
                job = group.jobs[index]
                if isinstance(event, Tokens):
                    token_times.setdefault(index, []).extend([time.monotonic()] * len(event.token_ids))
                    if job.chat_output is not None:
                        event = event.parsed(job.chat_output.feed(event.text))
                    yield index, event
                    continue
                rest = job.text.finish() if event.status is None else ""
                observed.add(index)
                self._observe(job, event, token_times.get(index, []), prompt=index == 0)
                if job.chat_output is not None and event.status is None:
                    delta = job.chat_output.end(rest)
                    if delta:
                        yield index, Tokens([]).parsed(delta)
                    event = dataclasses.replace(event, finish_reason=job.chat_output.finish_reason(event.finish_reason))
                elif rest:
                    yield index, Tokens([], [], rest)
                yield index, event
        finally:
            # Left early (the client went away or its deadline passed, a sample failed): the
            # samples end here (no effect on those that ended), and are recorded as they ended.
            group.finish(self._rpc_gone(group.leader))
            for index, job in enumerate(group.jobs):
                if job is not None and index not in observed:
                    self._observe(job, job.outcome, token_times.get(index, []), prompt=index == 0)

    @staticmethod
    def _rpc_gone(job: Job) -> Finished:
        return deadline_exceeded() if job.deadline_passed() else cancelled("client went away")

    async def _stream(self, group: SampleGroup, interval: int, context):
        pending: dict[int, Tokens] = {}
        async for index, event in self.outputs(group):
            if isinstance(event, Tokens):
                batch = pending.setdefault(index, Tokens([], [], ""))
                batch.token_ids += event.token_ids
                batch.logprobs += event.logprobs
                batch.text += event.text
                batch.reasoning += event.reasoning
                batch.tool_calls += event.tool_calls
                if len(batch.token_ids) >= interval:
                    yield self._chunk(group, index, pending.pop(index))
                continue
            batch = pending.pop(index, None)
            if batch is not None and (batch.token_ids or batch.text or batch.reasoning or batch.tool_calls):
                yield self._chunk(group, index, batch)
            if event.status is not None:
                await context.abort(event.status, event.message)
            yield self._final(group, index, event)

    def _observe(self, job: Job, finished: Finished, token_times: list[float], prompt: bool = True) -> None:
        """vLLM's definitions: TTFT, ITL (every gap), TPOT = (e2e - ttft) / (tokens - 1), e2e.
        ``prompt``: count the prompt's tokens (once per request: not again for its later samples)."""
        m = self.metrics
        if m is None:
            return
        t = job.timeline
        arrival, end = t["arrival"], t.get("finished", time.monotonic())
        # The stack's only count of served tokens (splitserve/common/metrics.py): workers count their work
        # apart; a request's prompt counts once, not again for its later samples.
        if prompt:
            m.prompt_tokens.inc(len(job.prompt_token_ids))
            m.request_prompt_tokens.observe(len(job.prompt_token_ids))
        m.generation_tokens.inc(len(token_times))
        m.request_generation_tokens.observe(len(token_times))
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

    # ---- messages ------------------------------------------------------------------------
    @staticmethod
    def _chunk(group: SampleGroup, index: int, tokens: Tokens) -> generation_pb2.GenerateResponse:
        chunk = generation_pb2.Chunk(token_ids=tokens.token_ids, text=tokens.text, reasoning_text=tokens.reasoning)
        for call in tokens.tool_calls:
            chunk.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)
        chunk.logprobs.extend(tokens.logprobs)
        return generation_pb2.GenerateResponse(chunk=chunk, request_id=group.request_id, index=index)

    def _final(self, group: SampleGroup, index: int, finished: Finished) -> generation_pb2.GenerateResponse:
        job = group.jobs[index]
        final = generation_pb2.Final(
            finish_reason=finished.finish_reason, matched_stop=job.text.matched or "",
            usage=generation_pb2.Usage(prompt_tokens=len(job.prompt_token_ids), completion_tokens=len(job.generated),
                                       cached_prompt_tokens=job.cached_prompt_tokens),
            timeline=generation_pb2.Timeline(**job.timeline_fields()),
            error=finished.message if finished.status else "")
        return generation_pb2.GenerateResponse(final=final, request_id=group.request_id, index=index)

    # ---- the other RPCs -------------------------------------------------------------------
    async def _lora(self, name: str) -> str | None:
        """The request's adapter, if it names one some worker serves (NOT_FOUND otherwise)."""
        if not name:
            return None
        served = await self.ledger.now(self.dispatcher.directory.loras())
        if name not in served:
            raise NotFound(f"lora: no worker serves the adapter {name!r}; "
                           f"{'served: ' + ', '.join(sorted(served)) if served else 'none is served'}")
        return name

    def _check_sizes(self, request) -> None:
        try:
            check_sizes(request, self.limits, self.model_info.max_model_len)
        except InvalidArgument:
            self.collector.soon()  # the refused message is freed by the cyclic collector (splitserve/gateway/memory.py)
            raise

    async def Abort(self, request, context):
        caller = self.authorizer.caller(context)
        for request_id in caller.addressed(request.request_id):
            if await self._abort(caller, request_id):
                return generation_pb2.AbortResponse(found=True)
        return generation_pb2.AbortResponse(found=False)

    async def _abort(self, caller, request_id: str) -> bool:
        job = self.dispatcher.jobs.get(request_id)
        found = job is not None and caller.may_touch(job.owner) and self.dispatcher.cancel(request_id)
        group = self._groups.get(request_id)
        if group is not None and caller.may_touch(group.leader.owner):
            found = group.finish(cancelled("aborted")) or found  # its samples, the first one ended or not
        owner = None if caller.admin else caller.owner  # checked in the same atomic step as the cancel
        return await self.ledger.now(self.state.cancel_pending(request_id, owner=owner)) or found

    async def GetRequest(self, request, context):
        caller = self.authorizer.caller(context)
        info = None
        for request_id in caller.addressed(request.request_id):
            info = await self.ledger.now(self.state.get(request_id))
            if info is not None and caller.may_touch(info.get("owner")):
                break
        if info is None or not caller.may_touch(info.get("owner")):
            raise NotFound(f"no request {request.request_id!r} (finished requests are kept for a while, then expire)")
        return request_info(request.request_id, info)

    async def Tokenize(self, request, context):
        # The same limits as a Generate's admission: its sizes, the gateway's room, the encoders' queue.
        if self.draining:
            raise Unavailable("the gateway is shutting down; send the request to another one")
        self._check_sizes(request)
        self.backpressure.check_room()
        ids = await self.prompts.token_ids(request)
        return generation_pb2.TokenizeResponse(token_ids=ids, tokens=self.tokenizer.convert_ids_to_tokens(ids))

    async def Detokenize(self, request, context):
        ids = request.token_ids
        if len(ids) > self.model_info.max_model_len:
            raise InvalidArgument(f"token_ids has {len(ids)} ids; at most max_model_len "
                                  f"({self.model_info.max_model_len}) are taken")
        for i, tok in enumerate(ids):
            if tok >= self.model_info.vocab_size:
                raise InvalidArgument(f"token_ids[{i}] is {tok}, must be < vocab_size ({self.model_info.vocab_size})")
        text = self.tokenizer.decode(list(ids), skip_special_tokens=request.skip_special_tokens)
        return generation_pb2.DetokenizeResponse(text=text)

    async def LoadLoRAAdapter(self, request, context):
        return await self.loras.load(request.lora_name, request.lora_path, self.authorizer.caller(context).admin)

    async def UnloadLoRAAdapter(self, request, context):
        return await self.loras.unload(request.lora_name, self.authorizer.caller(context).admin)

    async def GetModelInfo(self, request, context):
        return self.model_info

    async def GetServerInfo(self, request, context):
        admin = self.authorizer.caller(context).admin
        queue_depth = await self.ledger.now(self.state.queue_depth())
        if self.metrics is not None:
            self.metrics.queue_depth.set(queue_depth)
        workers = await self.ledger.now(self.dispatcher.directory.list())
        return server_info(queue_depth, self.dispatcher.gateway_id, self.metrics_address, workers, admin)


@dataclass(frozen=True)
class _Admission:
    """What every sample of one request shares."""
    token_ids: list[int]
    priority: int
    arrival_s: float  # Unix seconds: the request's (and each sample's) place in every queue
    deadline: float | None  # time.monotonic() seconds
    owner: str
    plan: OutputPlan  # what is done with the output besides relaying its text (a parser per sample)


def _duplicate_message(request_id: str, state: str | None, reuse_after_s: float) -> str:
    """Why a request id is taken: a live request has it, or one that ended moments ago."""
    if state in TERMINAL_STATES:
        return (f"request_id {request_id!r} belongs to a request that ended moments ago ({state}); an id can be "
                f"used again {reuse_after_s:g} s after its request ended")
    return (f"request_id {request_id!r} belongs to a request that is still running (state: {state}); a request id "
            "names one request: a second Generate does not attach to it (GetRequest reads it, Abort ends it)")

