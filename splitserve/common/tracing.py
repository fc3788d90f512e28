"""OpenTelemetry traces of a request across the gateway and the workers.

Off unless the standard ``OTEL_*`` variables ask for it: with none set, no tracer provider is
installed and every span below is the API's non-recording span (no export, next to no cost).

* ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``): export over OTLP/gRPC
  (batched; the exporter reads its own ``OTEL_EXPORTER_OTLP_*`` settings: headers, TLS, timeout).
* ``OTEL_TRACES_EXPORTER``: ``otlp``, ``console`` (stdout), ``none``, comma-separated; when set it
  wins over the endpoint rule above. ``OTEL_SDK_DISABLED=true`` turns everything off.
* ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` name the process; by default the service is
  ``splitserve-gateway``, ``splitserve-prefill`` or ``splitserve-decode`` (``-both``), with the
  gateway or worker id as ``service.instance.id``. ``OTEL_TRACES_SAMPLER`` works as usual.
* ``SPLITSERVE_TRACES_FILE=path`` (splitserve's own, for tests and debugging): every span is also
  appended to ``path`` as one JSON object per line, synchronously (a span is on disk once ended).

Spans of a request (parent -> children; the worker spans continue the gateway's trace through
the W3C ``traceparent`` gRPC metadata that the gateway sends on its worker calls):

    gateway  generate (root: admission to the request's end)
               admit                  validation, tokenization, the atomic Redis admission
               queue                  admitted (or put back) -> claimed by a dispatcher
               reserve  (client)  ->  decode worker: reserve (server)
               prefill  (client)  ->  prefill worker: prefill (server)
                                                       kv_transfer (first page write -> flush)
               decode   (client)  ->  decode worker: decode (server)
"""
from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Iterator, Mapping

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

TRACES_FILE_ENV = "SPLITSERVE_TRACES_FILE"
EXPORTERS = ("otlp", "console", "none")
ATTR_REQUEST_ID = "splitserve.request_id"
ATTR_WORKER_ID = "splitserve.worker_id"
# On kv_transfer: KV bytes the prefill worker wrote for this request, the amount the
# splitserve:kv_transfer_bytes counter grows by for it.
ATTR_KV_BYTES = "splitserve.kv.bytes"

# A proxy until ``setup`` installs a provider: modules may take it at import time.
_tracer = trace.get_tracer("splitserve")


# ---- configuration --------------------------------------------------------------------------

def exporter_names() -> list[str]:
    """The exporters the environment asks for (empty: tracing off)."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = env.get("OTEL_TRACES_EXPORTER", "").strip()
    if named:
        names = [n.strip().lower() for n in named.split(",") if n.strip()]
        unknown = [n for n in names if n not in EXPORTERS]
        if unknown:
            raise SystemExit(f"OTEL_TRACES_EXPORTER={named!r}: splitserve knows {', '.join(EXPORTERS)}, "
                             f"not {', '.join(unknown)}")
        names = [n for n in names if n != "none"]
    elif env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        names = ["otlp"]
    else:  # the spec's default is otlp; an unconfigured process exports nothing instead
        names = []
    if env.get(TRACES_FILE_ENV):
        names.append("file")
    return names


def span_processors() -> list:
    """The SDK span processors for ``exporter_names()`` (empty: tracing off)."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
    processors = []
    for name in exporter_names():
        if name == "otlp":
            protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
            if protocol != "grpc":
                raise SystemExit(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: splitserve exports OTLP over grpc "
                                 "only (point OTEL_EXPORTER_OTLP_ENDPOINT at the collector's gRPC port, 4317)")
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            processors.append(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            processors.append(BatchSpanProcessor(ConsoleSpanExporter()))
        else:  # file: line-buffered appends, one span per line, so several processes may share it
            out = open(os.environ[TRACES_FILE_ENV], "a", buffering=1)
            processors.append(SimpleSpanProcessor(ConsoleSpanExporter(
                out=out, formatter=lambda span: span.to_json(indent=None) + "\n")))
    return processors


def build_provider(role: str, instance_id: str):
    """A TracerProvider for a ``role`` process (gateway, prefill, decode, both) named
    ``instance_id``, or None when the environment configures no exporter."""
    processors = span_processors()
    if not processors:
        return None
    from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    ours = {SERVICE_NAME: f"splitserve-{role}", SERVICE_INSTANCE_ID: instance_id, "splitserve.role": role}
    from_env = OTELResourceDetector().detect().attributes  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES win
    provider = TracerProvider(resource=Resource.create({k: v for k, v in ours.items() if k not in from_env}))
    for processor in processors:
        provider.add_span_processor(processor)
    return provider


def setup(role: str, instance_id: str):
    """Install this process's tracer provider from the environment (once, at start); returns it,
    or None when tracing is off. The SDK flushes and shuts it down at exit."""
    provider = build_provider(role, instance_id)
    if provider is not None:
        trace.set_tracer_provider(provider)
    return provider


# ---- propagation over gRPC metadata ---------------------------------------------------------

def outgoing_metadata(span: trace.Span) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying ``span`` as the parent (``traceparent``); None when not traced."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items()) or None


def incoming_context(metadata: Mapping[str, str] | None):
    """The trace context a caller sent (gRPC invocation metadata as a mapping, or HTTP headers)."""
    return propagate.extract(metadata or {})


def http_parent(headers: Mapping[str, str]):
    """The parent of an HTTP request's ``generate`` span: the current context when the web
    framework already traces the request (FastAPI does, in recent versions, once a tracer provider
    is installed: its span continues the client's traceparent), else what the client sent."""
    if trace.get_current_span().get_span_context().is_valid:
        return None  # start_span(context=None) takes the current context
    return incoming_context(headers)


# ---- spans ---------------------------------------------------------------------------------

def _record_failure(span: trace.Span, exc: BaseException) -> None:
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        span.set_status(Status(StatusCode.ERROR, "cancelled"))  # the caller went away, or the request ended
        return
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        span.set_attribute("rpc.grpc.status_code", exc.code().value[0])
        span.set_status(Status(StatusCode.ERROR, f"{exc.code().name}: {exc.details()}"))
        return
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


@contextlib.contextmanager
def _span_scope(span: trace.Span) -> Iterator[trace.Span]:
    """End ``span`` on exit, with an error status if the block raised."""
    try:
        yield span
    except BaseException as exc:
        _record_failure(span, exc)
        raise
    finally:
        span.end()


@contextlib.contextmanager
def server_span(name: str, grpc_context, request_id: str, worker_id: str) -> Iterator[trace.Span]:
    """A worker's span of one RPC, child of the gateway's client span when the call carried one."""
    metadata = dict(grpc_context.invocation_metadata() or ())
    span = _tracer.start_span(name, context=incoming_context(metadata), kind=SpanKind.SERVER,
                              attributes={ATTR_REQUEST_ID: request_id, ATTR_WORKER_ID: worker_id})
    with _span_scope(span):
        yield span


def record_transfer(parent: trace.Span, result) -> None:
    """The KV handoff of a ``PrefillResult`` as a finished child span of ``parent`` (the prefill
    span): from the first page written to the flush, with the bytes the transfer metric counts."""
    end = result.transfer_end_ns or None
    span = _tracer.start_span("kv_transfer", context=trace.set_span_in_context(parent),
                              start_time=result.transfer_start_ns or end,
                              attributes={ATTR_REQUEST_ID: result.request_id, ATTR_KV_BYTES: result.bytes_sent,
                                          "splitserve.kv.transport": result.transport or "none",
                                          "splitserve.kv.copies": result.num_copies,
                                          "splitserve.kv.copy_seconds": result.transfer_s})
    if result.error is not None:
        span.set_status(Status(StatusCode.ERROR, str(result.error)))
    span.end(end_time=end)


class RequestTrace:
    """The gateway's spans of one request: the root ``generate`` span, ``admit``, one ``queue``
    span per wait in the queue, and client spans of the worker calls (children of the root).
    Every method is safe in any order and after ``end`` (then it does nothing): the claim loop
    may take a request before its admitting handler resumes, and a request may end anywhere."""

    def __init__(self, parent=None, recording: bool = True):
        """``parent``: the trace context the client sent (``incoming_context``), if any;
        ``recording`` False: a trace that records nothing (a job made without the servicer)."""
        if not recording:
            self.root = self._admit = trace.INVALID_SPAN
        else:
            # A server span where the request enters this process; under a span of this process
            # (the web framework's own HTTP span) an internal one.
            local = trace.get_current_span(parent).get_span_context()
            kind = SpanKind.INTERNAL if local.is_valid and not local.is_remote else SpanKind.SERVER
            self.root = _tracer.start_span("generate", context=parent, kind=kind)
            self._admit = _tracer.start_span("admit", context=trace.set_span_in_context(self.root))
        self.context = trace.set_span_in_context(self.root)
        self._queue: trace.Span | None = None
        self._ended = not recording
        # Worker calls under way: the root ends after the last (the request usually ends inside
        # the decode call, on its finishing chunk), so no child outlives it.
        self._open_calls = 0

    def identify(self, request_id: str, prompt_tokens: int, priority: int) -> None:
        self.root.set_attributes({ATTR_REQUEST_ID: request_id, "splitserve.prompt_tokens": prompt_tokens,
                                  "splitserve.priority": priority})

    def admitted(self) -> None:
        """In the Redis queue: admission is over, the wait starts."""
        if self._ended or self._admit is None:
            return
        self._admit.end()
        self._admit = None
        self.queued()

    def refused(self, exc: BaseException) -> None:
        """Admission failed (invalid, queue full, shutting down...): the request ends here."""
        if self._ended:
            return
        for span in (self._admit, self.root):
            if span is not None:
                _record_failure(span, exc)
                span.end()
        self._ended = True

    def queued(self) -> None:
        """Waiting in the queue (again, after a retry or a placement that found no room)."""
        if not self._ended and self._queue is None:
            self._queue = _tracer.start_span("queue", context=self.context)

    def claimed(self, attempt: int) -> None:
        """A dispatcher took the request out of the queue for attempt number ``attempt``."""
        if self._ended:
            return
        self.admitted()  # no-op unless the claim beat the handler's return from the admission
        if self._queue is not None:
            self._queue.set_attribute("splitserve.attempt", attempt)
            self._queue.end()
            self._queue = None

    def annotate(self, attributes: dict) -> None:
        """Attributes of the request (the root span), e.g. where its prompt was prefilled and why."""
        if not self._ended:
            self.root.set_attributes(attributes)

    @contextlib.contextmanager
    def call(self, name: str, worker_id: str, attempt: int) -> Iterator[tuple | None]:
        """A client span around a worker call; yields the gRPC metadata that carries it."""
        if self._ended:
            yield None
            return
        span = _tracer.start_span(name, context=self.context, kind=SpanKind.CLIENT,
                                  attributes={ATTR_WORKER_ID: worker_id, "splitserve.attempt": attempt})
        self._open_calls += 1
        try:
            with _span_scope(span):
                yield outgoing_metadata(span)
        finally:
            self._open_calls -= 1
            if self._ended and self._open_calls == 0:
                self.root.end()

    def end(self, finish_reason: str, error: str | None, completion_tokens: int, attempts: int) -> None:
        """The request ended (``Job.finish``); ``error`` None when it ended well."""
        if self._ended:
            return
        self._ended = True
        for span in (self._admit, self._queue):
            if span is not None:  # ended while admitting or queued (client gone, deadline, drain)
                span.end()
        self.root.set_attributes({"splitserve.finish_reason": finish_reason,
                                  "splitserve.completion_tokens": completion_tokens, "splitserve.attempts": attempts})
        if error is not None:
            self.root.set_status(Status(StatusCode.ERROR, error))
        if self._open_calls == 0:
            self.root.end()
