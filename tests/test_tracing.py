"""splitserve.common.tracing's configuration from the OTEL_* variables (no processes; the traces of a
running stack are tests/service/test_tracing.py's)."""
import json
import os

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from splitserve.common import tracing


@pytest.fixture
def clean_env(monkeypatch):
    """No OTEL_* variable and no traces file, whatever the shell running the tests has."""
    for name in list(os.environ):
        if name.startswith("OTEL_") or name == tracing.TRACES_FILE_ENV:
            monkeypatch.delenv(name)
    return monkeypatch


def test_without_otel_variables_nothing_is_exported(clean_env):
    assert tracing.exporter_names() == []
    assert tracing.span_processors() == []
    assert tracing.setup("gateway", "gw-1") is None
    # No provider was installed: the API's spans record nothing.
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)
    span = trace.get_tracer("t").start_span("x")
    assert not span.is_recording()
    span.end()
    # A request's trace is then non-recording too, and sends no traceparent.
    request = tracing.RequestTrace()
    with request.call("prefill", "p", 1) as metadata:
        assert metadata is None
    request.end("length", None, 1, 1)


def test_an_otlp_endpoint_turns_the_otlp_exporter_on(clean_env):
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    assert tracing.exporter_names() == ["otlp"]
    (processor,) = tracing.span_processors()
    try:
        assert isinstance(processor, BatchSpanProcessor)
        assert isinstance(processor.span_exporter, OTLPSpanExporter)
    finally:
        processor.shutdown()


@pytest.mark.parametrize("env, names", [
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, []),
    ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
    ({"OTEL_TRACES_EXPORTER": "otlp,console"}, ["otlp", "console"]),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, []),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}, ["otlp"]),
])
def test_exporters_follow_the_standard_variables(clean_env, env, names):
    for k, v in env.items():
        clean_env.setenv(k, v)
    assert tracing.exporter_names() == names


def test_refused_settings_say_what_to_change(clean_env):
    clean_env.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(SystemExit, match="zipkin"):
        tracing.exporter_names()
    clean_env.setenv("OTEL_TRACES_EXPORTER", "otlp")
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    with pytest.raises(SystemExit, match="grpc only"):
        tracing.span_processors()


def test_traces_file_gets_one_json_span_per_line_named_after_the_process(clean_env, tmp_path):
    path = tmp_path / "spans.jsonl"
    clean_env.setenv(tracing.TRACES_FILE_ENV, str(path))
    provider = tracing.build_provider("prefill", "prefill-7")
    try:
        tracer = provider.get_tracer("t")
        with tracer.start_as_current_span("outer"):
            tracer.start_span("inner").end()
        # Written as each span ends (no flush needed): a killed process loses nothing.
        spans = [json.loads(line) for line in path.read_text().splitlines()]
        assert [s["name"] for s in spans] == ["inner", "outer"]
        resource = spans[0]["resource"]["attributes"]
        assert resource["service.name"] == "splitserve-prefill"
        assert resource["service.instance.id"] == "prefill-7"
        assert spans[0]["parent_id"] == spans[1]["context"]["span_id"]
    finally:
        provider.shutdown()
    # OTEL_SERVICE_NAME names the service instead.
    clean_env.setenv("OTEL_SERVICE_NAME", "my-prefill")
    provider = tracing.build_provider("prefill", "prefill-7")
    try:
        assert provider.resource.attributes["service.name"] == "my-prefill"
        assert provider.resource.attributes["service.instance.id"] == "prefill-7"
    finally:
        provider.shutdown()


@pytest.fixture
def recorded(monkeypatch):
    """RequestTrace's spans, kept in memory (a local provider: the global one stays unset)."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    yield exporter
    provider.shutdown()


def test_a_claim_that_beats_the_admitting_handler_still_leaves_admit_then_queue(recorded):
    request = tracing.RequestTrace()
    request.claimed(1)  # the claim loop ran before the handler resumed after the Redis admission
    request.admitted()  # then a no-op
    request.end("length", None, 4, 1)
    spans = {s.name: s for s in recorded.get_finished_spans()}
    assert sorted(spans) == ["admit", "generate", "queue"]
    assert spans["admit"].end_time <= spans["queue"].start_time
    assert spans["queue"].attributes["splitserve.attempt"] == 1


def test_the_root_ends_after_the_call_the_request_ended_in(recorded):
    request = tracing.RequestTrace()
    request.admitted()
    request.claimed(1)
    with request.call("decode", "d0", 1) as metadata:
        assert dict(metadata)["traceparent"].split("-")[1] == format(request.root.get_span_context().trace_id, "032x")
        request.end("stop", None, 3, 1)  # Job.finish, on the finishing chunk
        assert [s.name for s in recorded.get_finished_spans()] == ["admit", "queue"]
    spans = {s.name: s for s in recorded.get_finished_spans()}
    assert spans["decode"].end_time <= spans["generate"].end_time
    assert spans["generate"].attributes["splitserve.finish_reason"] == "stop"
    # Nothing after the end records anything.
    request.queued()
    with request.call("prefill", "p0", 2) as metadata:
        assert metadata is None
    assert len(recorded.get_finished_spans()) == 4


def test_a_retry_waits_in_the_queue_again_and_failures_are_errors(recorded):
    from splitserve.common.errors import ResourceExhausted
    request = tracing.RequestTrace()
    request.admitted()
    request.claimed(1)
    with pytest.raises(ConnectionError):
        with request.call("prefill", "p0", 1):
            raise ConnectionError("worker died")
    request.queued()
    request.claimed(2)
    request.end("error", "UNAVAILABLE: gave up", 0, 2)
    spans = recorded.get_finished_spans()
    assert [s.attributes.get("splitserve.attempt") for s in spans if s.name == "queue"] == [1, 2]
    (prefill,) = [s for s in spans if s.name == "prefill"]
    assert prefill.status.status_code == trace.StatusCode.ERROR and "worker died" in prefill.status.description
    (root,) = [s for s in spans if s.name == "generate"]
    assert root.status.status_code == trace.StatusCode.ERROR and root.attributes["splitserve.attempts"] == 2
    # A refused admission ends the request's spans with the error.
    refused = tracing.RequestTrace()
    refused.refused(ResourceExhausted("queue full (7 requests unfinished); retry later"))
    more = recorded.get_finished_spans()[len(spans):]
    assert [s.name for s in more] == ["admit", "generate"]
    assert all("queue full" in s.status.description for s in more)
