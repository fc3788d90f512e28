"""Clients that never read their streams, and bursts past the queue limit, against a real stack
(issue 20, point 4).

* 40 streams opened by a client that never reads them (``tests.harness.hostile``: loopback,
  a 1 KiB HTTP/2 window) are cut after ``--slow-reader-timeout-s`` with RESOURCE_EXHAUSTED, long
  before their generation would have ended; their pages come back on every worker; meanwhile
  health and the other unary calls answer within a generous bound, another client's request is
  served correctly, and the gateway's memory stays flat. (Before the bounds, such requests ran to
  their end, ~36 s here, with every decode page in use, and the gateway kept all their tokens for
  as long as the client's connection lived.)
* A gateway past ``--max-buffered-bytes`` refuses new requests with RESOURCE_EXHAUSTED and a retry
  hint; a stream past ``--max-buffered-tokens-per-stream`` is cut; then the gateway serves again.
* ``--queue-limit`` triggers on one gateway: of a burst larger than the limit (and than the 64
  threads that used to cap what reached a gateway) the excess is refused at once with a retry
  hint, and every admitted request finishes.

The decode worker's steps are slowed (fault injection, 20 ms each), so a generation of 900
tokens lasts at least 18 s whatever the machine: a cut after a few seconds cannot be mistaken
for the request's own end. Every client is bounded: a fixed number of calls, each with a deadline.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from splitserve.client import Client
from splitserve.common.processes import free_port
from tests.harness.hostile import NeverReading
from tests.harness.stack import gateway_health, start_process, stop_process, wait_pages_at_baseline
from tests.harness.streams import join_all, run_streams
from tests.harness.tools import memory_mib, scrape
from splitserve.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(600)

SLOW_READER_TIMEOUT_S = 3.0
QUEUE_LIMIT = 80
STEP_DELAY_S = 0.02
# Prompt + max_tokens of the never-read streams fill the tiny model's context (1024).
PROMPT = [1, 2, 3]
MAX_TOKENS = 900
# Liveness bound on a unary call while the streams are stuck (they answer in milliseconds).
ANSWER_WITHIN_S = 2.0
# Gateway growth allowed over the whole test (measured: a few MiB).
GROWTH_MIB = 100.0
HTTP_PORT = free_port()


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    from tests.harness.stack import start_stack
    # Pages for every never-read stream at once (40 x 114), so all of them run together. Room in
    # the decode batch for the whole admitted burst: a decode worker given more handed-over
    # requests than --max-num-seqs fails its step (splitserve/engine/scheduler.py add_running does not
    # check it; found by the burst test, reported separately).
    running = start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=1,
                          worker_args=["--num-threads", "1", "--num-gpu-blocks", "6000",
                                       "--max-num-seqs", str(2 * QUEUE_LIMIT)],
                          role_env={"decode": {"SPLITSERVE_FAULT_STEP_DELAY_S": str(STEP_DELAY_S)}},
                          gateway_args=["--slow-reader-timeout-s", str(SLOW_READER_TIMEOUT_S),
                                        "--queue-limit", str(QUEUE_LIMIT), "--http-port", str(HTTP_PORT)])
    try:
        running.baseline = running.free_pages()
        yield running
    finally:
        running.close()


class Prober(threading.Thread):
    """Health checks and GetServerInfo calls, one after another, until stopped; every answer's time."""

    def __init__(self, stack):
        super().__init__(daemon=True)
        self.stack, self.stop, self.times, self.failures = stack, threading.Event(), [], []
        self.max_unread = 0.0

    def run(self):
        while not self.stop.is_set():
            start = time.monotonic()
            status = gateway_health(self.stack, timeout_s=10)
            try:
                self.stack.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
            except grpc.RpcError as e:
                self.failures.append(e.code())
            self.times.append(time.monotonic() - start)
            if status != health_pb2.HealthCheckResponse.SERVING:
                self.failures.append(status)
            self.max_unread = max(self.max_unread, unread_bytes(self.stack))
            self.stop.wait(0.2)


def unread_bytes(stack, name: str = "gateway") -> float:
    return scrape(stack.metrics_ports[name]).get("splitserve:unread_output_bytes", 0.0)


def states(stack, request_ids) -> dict[str, tuple[str, str]]:
    out = {}
    for rid in request_ids:
        try:
            info = stack.stub.GetRequest(pb.GetRequestRequest(request_id=rid), timeout=10)
        except grpc.RpcError as e:  # not admitted yet
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            out[rid] = ("", "")
            continue
        out[rid] = (info.state, info.error)
    return out


def wait_ended(stack, request_ids, timeout_s: float) -> dict[str, tuple[str, str]]:
    """Every request's (state, error) once all are aborted, or as they are after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = states(stack, request_ids)
        if all(state == "aborted" for state, _ in seen.values()) or time.monotonic() > deadline:
            return seen
        time.sleep(0.25)


def test_streams_nobody_reads_are_cut_and_the_gateway_stays_responsive(stack, reference):
    pid = stack.procs["gateway"].pid
    rss_before = memory_mib(pid)["rss"]
    prober = Prober(stack)
    prober.start()
    start = time.monotonic()
    try:
        with NeverReading(stack.gateway_address, 40, PROMPT, MAX_TOKENS, tag="unread") as hostile:
            # Another client, meanwhile: served in full, token for token.
            bystander = run_streams(stack, "bystander", [[5, 6, 7, 8]], max_tokens=32)
            join_all(bystander, timeout_s=120)
            assert bystander[0].code is None, bystander[0].error
            assert bystander[0].tokens == reference.greedy([5, 6, 7, 8], 32)
            ended = wait_ended(stack, hostile.request_ids, timeout_s=90)
            cut_after = time.monotonic() - start
            # "aborted" (not "finished"): each was cut before its generation ended.
            wrong = {rid: s for rid, s in ended.items()
                     if s != ("aborted", f"the client did not read its stream for {SLOW_READER_TIMEOUT_S:g} s "
                                         "(--slow-reader-timeout-s)")}
            assert not wrong, wrong
            # The client that finally reads gets what fit its window, then the reason.
            read, code, details = hostile.read_one(0)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "did not read its stream" in details
            assert 0 < read < MAX_TOKENS
        wait_pages_at_baseline(stack, stack.baseline, timeout_s=60)
    finally:
        prober.stop.set()
        prober.join(30)
    print(f"40 unread streams cut within {cut_after:.1f} s; health + GetServerInfo: {len(prober.times)} rounds, "
          f"slowest {max(prober.times) * 1000:.0f} ms; unread output peaked at {prober.max_unread / 1024:.0f} KiB")
    assert not prober.failures and max(prober.times) < ANSWER_WITHIN_S, (prober.failures, max(prober.times))
    assert prober.max_unread > 0, "the client read after all: nothing waited at the gateway"
    samples = scrape(stack.metrics_ports["gateway"])
    assert samples["splitserve:unread_output_bytes"] == 0
    assert samples["splitserve:slow_readers_cut_total"] >= 40
    assert memory_mib(pid)["rss"] - rss_before < GROWTH_MIB


def test_a_stream_whose_first_message_never_fits_is_cut_with_its_status(stack):
    # 100 tokens with logprobs make a first message of several KiB: it never fits the 1 KiB
    # window. A status cannot be sent beside a pending first send (which carries the headers):
    # before the gateway sent the headers up front, such a stream was left to its deadline.
    with NeverReading(stack.gateway_address, 1, PROMPT, MAX_TOKENS, tag="first", stream_interval=100,
                      logprobs=5) as hostile:
        ended = wait_ended(stack, hostile.request_ids, timeout_s=60)
        assert ended["first-0"] == ("aborted", f"the client did not read its stream for "
                                               f"{SLOW_READER_TIMEOUT_S:g} s (--slow-reader-timeout-s)")
        start = time.monotonic()
        read, code, details = hostile.read_one(0)
        assert read <= 1 and code == grpc.StatusCode.RESOURCE_EXHAUSTED and "did not read" in details
        assert time.monotonic() - start < 30, "the status came at once, not at the call's deadline"
    wait_pages_at_baseline(stack, stack.baseline, timeout_s=60)


def test_a_burst_past_the_queue_limit_is_refused_and_the_rest_served(stack, reference):
    # 100 at once on one gateway: more than the limit, more than the 64 threads that once
    # served the gateway. Each admitted request lasts at least 200 slowed steps (4 s), so none
    # frees its place before the whole burst has arrived.
    wait_pages_at_baseline(stack, stack.baseline, timeout_s=60)
    streams = run_streams(stack, "burst", [[9, 10, 11]] * 100, max_tokens=200)
    join_all(streams, timeout_s=300)
    refused = [s for s in streams if s.code is not None]
    served = [s for s in streams if s.code is None]
    assert len(refused) == 100 - QUEUE_LIMIT, [(s.code, s.error) for s in refused][:5]
    assert all(s.code == grpc.StatusCode.RESOURCE_EXHAUSTED and s.retry_after_ms for s in refused)
    assert all("queue full" in s.error for s in refused), refused[0].error
    expected = reference.greedy([9, 10, 11], 200)
    assert all(s.final is not None and s.tokens == expected for s in served)
    wait_pages_at_baseline(stack, stack.baseline, timeout_s=60)


def test_the_gateway_bounds_unread_output_in_total_and_per_stream(stack, tmp_path):
    """A second gateway (same Redis and workers) whose bounds trip before its timeout would."""
    gateway, address = start_process(
        [*stack.argv["gateway"], "--http-port", "-1", "--max-buffered-bytes", "10000", "--max-buffered-tokens-per-stream", "400",
         "--slow-reader-timeout-s", "600"], tmp_path / "gateway-bounded.log")
    client = Client(address)
    try:
        deadline = time.monotonic() + 60
        while len(client.server_info().workers) < 1 + len(stack.roles) and time.monotonic() < deadline:
            time.sleep(0.2)
        small = pb.GenerateRequest(token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=1, temperature=0.0))
        assert list(client.stub.Generate(small, timeout=60))[-1].final.finish_reason == "length"
        with NeverReading(address, 5, PROMPT, MAX_TOKENS, tag="bounded") as hostile:
            # 5 stuck streams pass 10,000 bytes at ~55 waiting tokens each, and each is cut at 400:
            # in between, a new request is refused.
            refusal = None
            deadline = time.monotonic() + 60
            while refusal is None and time.monotonic() < deadline:
                try:
                    list(client.stub.Generate(small, timeout=60))
                except grpc.RpcError as e:
                    refusal = e
                time.sleep(0.1)
            assert refusal is not None and refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-buffered-bytes 10000" in refusal.details()
            assert dict(refusal.trailing_metadata())["retry-after-ms"] == "1000"
            ended = wait_ended(stack, hostile.request_ids, timeout_s=90)
            assert all(state == "aborted" and "--max-buffered-tokens-per-stream 400" in error
                       for state, error in ended.values()), ended
        # Their output dropped with them: the gateway serves again.
        assert list(client.stub.Generate(small, timeout=60))[-1].final.finish_reason == "length"
        wait_pages_at_baseline(stack, stack.baseline, timeout_s=60)
    finally:
        client.close()
        stop_process(gateway, tmp_path / "gateway-bounded.log")


def _never_read_http(request_id: str) -> socket.socket:
    """A streamed /v1/completions whose client never reads (a 4 KiB receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", HTTP_PORT))
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                       "logprobs": 5, "request_id": request_id}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def test_http_streams_nobody_reads_are_cut_too(stack):
    """The OpenAI HTTP API's streams fall under the same timeout: cut (aborted, pages back on
    every worker) long before their 900 tokens would have ended; the connection is closed."""
    ids = [f"http-unread-{i}" for i in range(4)]
    sockets = [_never_read_http(rid) for rid in ids]
    try:
        ended = wait_ended(stack, ids, timeout_s=60)
        assert all(state == "aborted" and "did not read its stream" in error for state, error in ended.values()), ended
        wait_pages_at_baseline(stack, stack.baseline, timeout_s=60)
        sockets[0].settimeout(10)
        received = b""
        while chunk := sockets[0].recv(65536):  # what fit the window, then the end of the connection
            received += chunk
        assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
    finally:
        for sock in sockets:
            sock.close()

