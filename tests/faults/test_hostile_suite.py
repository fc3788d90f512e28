"""Hostile input, second round, all at once (issue 36, "Done means").

One real stack (Redis, gateway with its OpenAI HTTP API, a prefill and a decode worker) takes the
shapes of issue 36 one after another -- deep and over-sized schemas, a wide one, many distinct
grammars at once, a body over the HTTP cap, a slow upload, a slow request head, clients that
vanish mid-stream, a huge text to tokenize, and a claim whose reply the gateway loses
(``SPLITSERVE_FAULT_LOSE_CLAIM_REPLY``) -- while

* a bystander sends greedy requests in a loop, each checked token for token against
  transformers, and
* a poller asks the gateway's gRPC health service and its HTTP ``/health`` every 0.1 s.

Every hostile call must get its documented answer, every bystander request its exact tokens, every
health answer SERVING / 200 in under ``HEALTH_BOUND_S``; afterwards every KV page is back.
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2

from splitserve.gateway.claim import LOSE_CLAIM_REPLY_ENV
from splitserve.v1 import generation_pb2 as pb
from tests.harness.hostile import NeverReading
from tests.harness.prompts import mixed_prompts
from tests.harness.stack import health, start_stack, wait_pages_at_baseline

pytestmark = pytest.mark.timeout(600)

HEALTH_BOUND_S = 0.5
BODY_TIMEOUT_S = 2.0
HEADER_TIMEOUT_S = 2.0
MAX_MESSAGE_MB = 4
BYSTANDER_TOKENS = 12
RPC_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    # Workers op by op: what is measured here is the gateway, and a compile of each would only
    # lengthen the set-up.
    running = start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=1, http=True,
                          worker_args=["--num-threads", "1", "--enforce-eager"],
                          gateway_args=["--max-message-mb", str(MAX_MESSAGE_MB),
                                        "--http-body-timeout-s", str(BODY_TIMEOUT_S),
                                        "--http-header-timeout-s", str(HEADER_TIMEOUT_S)],
                          gateway_env={LOSE_CLAIM_REPLY_ENV: "4"})
    try:
        running.baseline = running.free_pages()
        yield running
    finally:
        running.close()


class HealthPoller(threading.Thread):
    """gRPC health (readiness) and HTTP /health every 0.1 s: the slowest answer, and any bad one."""

    def __init__(self, stack):
        super().__init__(name="health-poller", daemon=True)
        self.channel = grpc.insecure_channel(stack.gateway_address)
        self.http = stack.http
        self.stop = threading.Event()
        self.slowest = {"grpc": 0.0, "http": 0.0}
        self.bad: list[str] = []
        self.polls = 0

    def run(self) -> None:
        host, port = self.http.removeprefix("http://").rsplit(":", 1)
        while not self.stop.is_set():
            start = time.monotonic()
            status = health(self.channel, 5.0, service="splitserve.v1.Generation")
            self._note("grpc", start, status == health_pb2.HealthCheckResponse.SERVING, status)
            start = time.monotonic()
            try:
                conn = http.client.HTTPConnection(host, int(port), timeout=5)
                conn.request("GET", "/health")
                code = conn.getresponse().status
                conn.close()
            except OSError as e:
                code = repr(e)
            self._note("http", start, code == 200, code)
            self.polls += 1
            self.stop.wait(0.1)
        self.channel.close()

    def _note(self, kind: str, start: float, ok: bool, answer) -> None:
        took = time.monotonic() - start
        self.slowest[kind] = max(self.slowest[kind], took)
        if not ok:
            self.bad.append(f"{kind}: {answer}")


class Bystander(threading.Thread):
    """Greedy requests in a loop, each compared with transformers' output."""

    def __init__(self, stack, reference):
        super().__init__(name="bystander", daemon=True)
        self.client = stack.client
        self.prompts = mixed_prompts(4, seed=36, lo=4, hi=40)
        self.expected = [reference.greedy(p, BYSTANDER_TOKENS) for p in self.prompts]
        self.stop = threading.Event()
        self.done = 0
        self.wrong: list[str] = []

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            prompt, expected = self.prompts[i % 4], self.expected[i % 4]
            try:
                tokens = [t for e in self.client.generate(prompt, max_tokens=BYSTANDER_TOKENS, temperature=0.0,
                                                          ignore_eos=True, timeout=RPC_TIMEOUT_S) for t in e.token_ids]
                if tokens != expected:
                    self.wrong.append(f"request {i}: {tokens} != {expected}")
            except grpc.RpcError as e:
                self.wrong.append(f"request {i}: {e.code().name} {e.details()}")
            self.done += 1
            i += 1


def code_of(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def constrained(stack, **structured):
    return lambda: stack.client.complete("hi", max_tokens=6, temperature=0.0, timeout=RPC_TIMEOUT_S,
                                         structured_output=pb.StructuredOutput(**structured))


def deep_schema(levels: int) -> str:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return json.dumps(schema)


def wide_schema(properties: int) -> str:
    return json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(properties)}})


def http_status(stack, head: bytes, body_chunks=(), gap_s: float = 0.0, timeout_s: float = 30) -> tuple[int, float]:
    """Send ``head`` then each chunk ``gap_s`` apart on a raw connection: the status the server
    answers, and the seconds from the first byte to its answer (0 if it closed without one)."""
    host, port = stack.http.removeprefix("http://").rsplit(":", 1)
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        try:
            sock.sendall(head)
            for chunk in body_chunks:
                time.sleep(gap_s)
                sock.sendall(chunk)
        except OSError:  # the server answered and closed while we were still sending
            pass
        answer = b""
        try:
            while b"\r\n" not in answer:
                data = sock.recv(4096)
                if not data:
                    break
                answer += data
        except OSError:
            pass
    took = time.monotonic() - start
    return (int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0), took


def completions_head(length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_hostile_shapes_while_a_bystander_is_served_exactly_and_health_answers(stack, reference):
    # The gateway starts its grammar checker (a child that imports torch: a second or two of both
    # cores here) at the first spec it sees; that start, not any hostile shape, once delayed a
    # health answer by 0.3 s. Started before the clock runs.
    assert code_of(constrained(stack, regex="[a-f]{2}"))[0] == grpc.StatusCode.OK
    poller, bystander = HealthPoller(stack), Bystander(stack, reference)
    poller.start()
    bystander.start()
    answers: dict[str, tuple] = {}
    try:
        answers["deep schema"] = code_of(constrained(stack, json_schema=deep_schema(300)))
        answers["over-sized schema"] = code_of(constrained(stack, json_schema=wide_schema(3000)))
        answers["wide schema"] = code_of(constrained(stack, json_schema=wide_schema(300)))
        with ThreadPoolExecutor(8) as pool:  # distinct grammars, at once
            answers["distinct grammars"] = tuple(pool.map(
                lambda i: code_of(constrained(stack, regex=f"g{i}[a-f]{{{1 + i % 5}}}"))[0], range(40)))
        answers["huge text"] = code_of(lambda: stack.client.tokenize("x" * ((MAX_MESSAGE_MB << 20) // 2)))
        big = MAX_MESSAGE_MB << 20
        answers["body over the cap"] = http_status(stack, completions_head(big + 1024), [b"x" * big])
        answers["slow upload"] = http_status(stack, completions_head(1000), [b"{"] * 20, gap_s=0.5)
        answers["slow head"] = http_status(stack, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        with NeverReading(stack.gateway_address, 20, [1, 2, 3], 200, tag="vanishing") as vanishing:
            time.sleep(1.0)  # streaming, unread; closing cancels every one of them
    finally:
        bystander.stop.set()
        bystander.join(RPC_TIMEOUT_S + 10)
        poller.stop.set()
        poller.join(30)
    print(f"bystander requests {bystander.done}, health polls {poller.polls}, slowest health answers (s) "
          f"{poller.slowest}, answers {answers}")
    ok, invalid = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT
    assert answers["deep schema"][0] == invalid and "--max-schema-depth" in answers["deep schema"][1]
    assert answers["over-sized schema"][0] == invalid and "--max-grammar-bytes" in answers["over-sized schema"][1]
    assert answers["wide schema"][0] == ok, answers["wide schema"]
    assert answers["distinct grammars"] == (ok,) * 40
    assert answers["huge text"][0] == invalid and "--max-prompt-bytes" in answers["huge text"][1]
    assert answers["body over the cap"][0] == 413
    status, took = answers["slow upload"]
    assert status == 408 and took < BODY_TIMEOUT_S + 5, answers["slow upload"]
    status, took = answers["slow head"]
    assert status == 408 and took < HEADER_TIMEOUT_S + 5, answers["slow head"]
    assert len(vanishing.request_ids) == 20
    # The bystander: served throughout, every token right.
    assert bystander.done >= 3 and not bystander.wrong, bystander.wrong
    # Health: every answer good and quick.
    assert poller.polls >= 10 and not poller.bad, poller.bad
    assert max(poller.slowest.values()) < HEALTH_BOUND_S, poller.slowest
    # The claim whose reply was lost was adopted, not stranded (every request above ended).
    log = stack.log_paths["gateway"].read_text()
    assert "reply of the claim" in log and "ran in Redis but the reply was lost" in log
    wait_pages_at_baseline(stack, stack.baseline)
