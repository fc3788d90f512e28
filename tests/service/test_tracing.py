"""Traces of a real stack: a gateway, a prefill and a decode worker, each appending its spans to
its own file (SPLITSERVE_TRACES_FILE); requests sent with a client's traceparent."""
import json
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from splitserve.client import build_request
from tests.harness.stack import start_stack
from tests.harness.tools import scrape
from splitserve.common.tracing import ATTR_KV_BYTES, ATTR_REQUEST_ID, TRACES_FILE_ENV

PROCESSES = ("gateway", "prefill", "decode")
TRANSFER_BYTES = "splitserve:kv_transfer_bytes_total"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC receiver on loopback: the spans exported to it, as (service name, span)."""

    def __init__(self):
        self.spans = []
        self.server = grpc.server(ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
            self.spans += [(service, span) for scope in resource_spans.scope_spans for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def traced(tiny_model_dirs, tmp_path_factory):
    """The stack; each process appends its spans to its own file, and the gateway also exports
    over OTLP to a collector (batches sent every 100 ms)."""
    files = {name: tmp_path_factory.mktemp("traces") / f"{name}.jsonl" for name in PROCESSES}
    env = {name: {TRACES_FILE_ENV: str(path)} for name, path in files.items()}
    collector = Collector()
    env["gateway"].update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{collector.port}",
                          OTEL_BSP_SCHEDULE_DELAY="100")
    stack = start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=1, http=True,
                        role_env={"prefill": env["prefill"], "decode": env["decode"]}, gateway_env=env["gateway"])
    try:
        yield stack, files, collector
    finally:
        stack.close()
        collector.server.stop(0)


def transfer_bytes(stack) -> float:
    """The prefill worker's KV bytes counter, summed over transports (absent before any transfer)."""
    return sum(v for k, v in scrape(stack.metrics_ports["prefill"]).items() if k.startswith(TRANSFER_BYTES))


def lines(files) -> dict[str, int]:
    """How many spans each file holds now (the spans of a test are those after)."""
    return {name: len(path.read_text().splitlines()) if path.exists() else 0 for name, path in files.items()}


def read_spans(files, since: dict[str, int], trace_id: str, wanted: dict[str, set[str]],
               ready=lambda spans: True, timeout_s: float = 15.0) -> dict[str, list]:
    """Every process's spans after ``since`` once each holds the span names in ``wanted`` for
    ``trace_id`` and ``ready(spans)`` holds (a worker ends its span a moment after the client has
    its last message, and an HTTP server its span a moment after the response)."""
    give_up = time.monotonic() + timeout_s
    while True:
        spans = {name: [json.loads(line) for line in path.read_text().splitlines()[since[name]:]]
                 if path.exists() else [] for name, path in files.items()}
        seen = {name: {s["name"] for s in spans[name] if s["context"]["trace_id"] == trace_id} for name in files}
        if (all(wanted[name] <= seen[name] for name in files) and ready(spans)) or time.monotonic() > give_up:
            return spans
        time.sleep(0.2)


def top(spans: list, span: dict) -> dict:
    """``span``'s farthest ancestor among ``spans``."""
    by_id = {s["context"]["span_id"]: s for s in spans}
    while span["parent_id"] in by_id:
        span = by_id[span["parent_id"]]
    return span


def when(span, field):
    return datetime.fromisoformat(span[field].replace("Z", "+00:00"))


def within(child, parent) -> bool:
    return when(parent, "start_time") <= when(child, "start_time") <= when(child, "end_time") <= when(
        parent, "end_time")


def test_one_request_is_one_trace_across_gateway_prefill_and_decode(traced):
    stack, files, collector = traced
    before, since = transfer_bytes(stack), lines(files)
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    request = build_request(list(range(5, 45)), request_id="traced-1", max_tokens=4, temperature=0.0,
                            ignore_eos=True)
    responses = list(stack.stub.Generate(request, timeout=60,
                                         metadata=[("traceparent", f"00-{trace_id}-{client_span}-01")]))
    assert responses[-1].final.finish_reason == "length"
    transferred = transfer_bytes(stack) - before
    assert transferred > 0

    trace_id = "0x" + trace_id
    wanted = {"gateway": {"generate", "admit", "queue", "reserve", "prefill", "decode"},
              "prefill": {"prefill", "kv_transfer"}, "decode": {"reserve", "decode"}}
    spans = read_spans(files, since, trace_id, wanted)
    # One request, one trace: nothing else in these processes made spans (probes are not traced).
    for name in PROCESSES:
        assert {s["context"]["trace_id"] for s in spans[name]} == {trace_id}, name
        assert sorted(s["name"] for s in spans[name]) == sorted(wanted[name]), name
    by_name = {name: {s["name"]: s for s in spans[name]} for name in PROCESSES}
    gw, pf, dc = by_name["gateway"], by_name["prefill"], by_name["decode"]

    # Each process names itself: its service and its id.
    services = {name: spans[name][0]["resource"]["attributes"] for name in PROCESSES}
    assert [services[n]["service.name"] for n in PROCESSES] == [
        "splitserve-gateway", "splitserve-prefill", "splitserve-decode"]
    for name in ("prefill", "decode"):
        worker_id = stack.argv[name][stack.argv[name].index("--worker-id") + 1]
        assert services[name]["service.instance.id"] == worker_id

    def span_id(span):
        return span["context"]["span_id"]

    # The gateway's request span continues the client's trace; the rest of the gateway hangs under it.
    root = gw["generate"]
    assert root["parent_id"] == "0x" + client_span and root["kind"] == "SpanKind.SERVER"
    assert root["attributes"][ATTR_REQUEST_ID] == "traced-1"
    # Where its prompt was prefilled, and why (conditional disaggregation; the default sends it remote).
    assert (root["attributes"]["splitserve.prefill_placement"],
            root["attributes"]["splitserve.prefill_placement_reason"]) == ("remote", "always")
    for name in ("admit", "queue", "reserve", "prefill", "decode"):
        assert gw[name]["parent_id"] == span_id(root) and within(gw[name], root), name
    assert [gw[n]["kind"] for n in ("reserve", "prefill", "decode")] == ["SpanKind.CLIENT"] * 3
    # admit, then queue, then the calls, in that order.
    assert when(gw["admit"], "end_time") <= when(gw["queue"], "start_time")
    assert when(gw["queue"], "end_time") <= when(gw["reserve"], "start_time")
    assert when(gw["reserve"], "end_time") <= when(gw["prefill"], "start_time")
    assert when(gw["prefill"], "end_time") <= when(gw["decode"], "start_time")

    # Worker server spans are children of the gateway's client spans (traceparent over gRPC).
    assert dc["reserve"]["parent_id"] == span_id(gw["reserve"])
    assert pf["prefill"]["parent_id"] == span_id(gw["prefill"])
    assert dc["decode"]["parent_id"] == span_id(gw["decode"])
    for server, client in ((dc["reserve"], gw["reserve"]), (pf["prefill"], gw["prefill"])):
        assert server["kind"] == "SpanKind.SERVER" and within(server, client), server["name"]
    # A stream's server span may end a moment after the client read the last message; it starts inside.
    assert dc["decode"]["kind"] == "SpanKind.SERVER"
    assert when(gw["decode"], "start_time") <= when(dc["decode"], "start_time") <= when(gw["decode"], "end_time")
    assert dc["decode"]["attributes"]["splitserve.tokens_streamed"] == 3  # the first came from prefill

    # The KV transfer hangs under the prefill, inside it, and its bytes are the metric's.
    transfer = pf["kv_transfer"]
    assert transfer["parent_id"] == span_id(pf["prefill"]) and within(transfer, pf["prefill"])
    assert transfer["attributes"][ATTR_KV_BYTES] == transferred
    assert all(s["status"]["status_code"] == "UNSET" for name in PROCESSES for s in spans[name])

    # The gateway exports the same spans over OTLP/gRPC (OTEL_EXPORTER_OTLP_ENDPOINT).
    give_up = time.monotonic() + 15
    while len(exported := [(service, span) for service, span in collector.spans
                           if "0x" + span.trace_id.hex() == trace_id]) < len(spans["gateway"]):
        assert time.monotonic() < give_up, f"the collector got {len(exported)} spans of the trace"
        time.sleep(0.1)
    assert sorted(span.name for _, span in exported) == sorted(wanted["gateway"])
    assert {service for service, _ in exported} == {"splitserve-gateway"}
    assert {"0x" + span.span_id.hex() for _, span in exported} == {span_id(s) for s in spans["gateway"]}


def test_an_http_request_continues_the_clients_trace_too(traced):
    stack, files, _ = traced
    since = lines(files)
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    answer = httpx.post(stack.http + "/v1/completions", timeout=60,
                        json={"prompt": "tell me", "max_tokens": 3, "temperature": 0.0},
                        headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    assert answer.status_code == 200, answer.text
    # The request's span hangs under the client's, or under FastAPI's own spans of the HTTP request
    # (recent FastAPI versions trace requests once a tracer provider is installed), the first of
    # which is the client's child.
    def generate(spans):
        return [s for s in spans["gateway"] if s["name"] == "generate"]

    def reaches_client(spans):
        return any(top(spans["gateway"], s)["parent_id"] == "0x" + client_span for s in generate(spans))
    spans = read_spans(files, since, "0x" + trace_id, {"gateway": {"generate"}, "prefill": {"prefill"},
                                                       "decode": {"decode"}}, ready=reaches_client)
    (root,) = generate(spans)
    assert root["context"]["trace_id"] == "0x" + trace_id
    span = top(spans["gateway"], root)
    assert span["parent_id"] == "0x" + client_span and span["kind"] == "SpanKind.SERVER"
    assert root["kind"] == ("SpanKind.SERVER" if span is root else "SpanKind.INTERNAL")
    for name in ("prefill", "decode"):
        assert {s["context"]["trace_id"] for s in spans[name]} == {"0x" + trace_id}, name
