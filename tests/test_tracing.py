"""splitserve.tracing's configuration from the OTEL_* variables (no processes; the traces of a
running stack are tests/service/test_tracing.py's)."""
import json
import os

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from splitserve import tracing


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
