"""The OpenAI-compatible HTTP API, through the real ``openai`` package, curl and raw sockets,
on a real stack (Redis, a gateway, a prefill and a decode worker) serving the real default model
in fp32: greedy answers equal ``transformers``' token for token, streams equal whole answers,
errors are OpenAI's bodies with the right status, and a client that disconnects gives every
KV page back on every worker."""
import asyncio
import http.client
import json
import socket
import subprocess
import sys
from pathlib import Path
import time

import grpc
import httpx
import openai
import pytest

from splitserve.engine.model_loader import DEFAULT_MODEL
from splitserve.common.processes import free_port
from tests.harness.redis_server import RedisServer
from tests.harness.stack import start_process, wait_pages_at_baseline
from tests.harness.streams import wait_until
from splitserve.v1 import generation_pb2

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time, a small robot"]
TOKEN = "http-test-token"


@pytest.fixture(scope="module")
def stack(smollm2_stack):
    return smollm2_stack


@pytest.fixture(scope="module")
def client(openai_client):
    return openai_client


@pytest.fixture
def baseline(stack):
    return stack.free_pages()


GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def expected_text(reference, tokenizer, prompt_ids, max_tokens):
    # The text skips special tokens, as vLLM's does by default.
    return tokenizer.decode(reference.greedy(prompt_ids, max_tokens), skip_special_tokens=True)


# ---- correctness -----------------------------------------------------------------------

def test_completions_equal_transformers_greedy_for_text_and_token_prompts(client, tokenizer, reference):
    for prompt in PROMPTS[:2]:
        ids = tokenizer.encode(prompt)
        want = expected_text(reference, tokenizer, ids, 12)
        got = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=12, **GREEDY)
        assert got.choices[0].text == want
        assert got.choices[0].finish_reason == "length"
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), 12)
        by_ids = client.completions.create(model=DEFAULT_MODEL, prompt=ids, max_tokens=12, **GREEDY)
        assert by_ids.choices[0].text == want


def test_concurrent_async_requests_equal_transformers_greedy(stack, tokenizer, reference):
    """A mixed batch: four prompts of different lengths and outputs at once, through AsyncOpenAI."""
    lengths = [6, 14, 9, 20]

    async def main():
        async with openai.AsyncOpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*(c.completions.create(model=DEFAULT_MODEL, prompt=p, max_tokens=n, **GREEDY)
                                          for p, n in zip(PROMPTS, lengths)))
    answers = asyncio.run(main())
    for prompt, n, answer in zip(PROMPTS, lengths, answers):
        assert answer.choices[0].text == expected_text(reference, tokenizer, tokenizer.encode(prompt), n), prompt


def test_chat_streamed_equals_whole_and_the_template_applied(client, tokenizer, reference):
    messages = [{"role": "user", "content": "Name three colors."}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)
    want = expected_text(reference, tokenizer, ids, 16)
    whole = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=16, **GREEDY)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want
    assert whole.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_with_n_streams_every_choice_with_its_role_and_end(client, tokenizer, reference):
    messages = [{"role": "user", "content": "Name a color."}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)
    want = expected_text(reference, tokenizer, ids, 6)
    chunks = list(client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=6, n=2,
                                                 stream=True, stream_options={"include_usage": True}, **GREEDY))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert "".join(c.delta.content or "" for c in mine) == want  # greedy: equal samples
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 12


def test_logprobs_and_stop_strings(client, tokenizer, reference):
    prompt = PROMPTS[0]
    ids = tokenizer.encode(prompt)
    want_ids = reference.greedy(ids, 8)
    got = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=8, logprobs=2, **GREEDY)
    lp = got.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in want_ids]
    assert all(v <= 0 for v in lp.token_logprobs)
    # Greedy: the sampled token is the most likely of its alternatives.
    assert all(max(top.values()) == v for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 3 for e in content)
    # A stop string ends the text before it, reason "stop".
    full = expected_text(reference, tokenizer, ids, 8)
    stop = full.strip().split()[1]
    cut = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=8, stop=[stop], **GREEDY)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[:full.index(stop)]


def test_curl_streams_server_sent_events_and_reads_models_and_health(stack, tokenizer, reference):
    body = json.dumps({"model": DEFAULT_MODEL, "prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    out = subprocess.run(["curl", "-sN", "--max-time", "60", stack.http + "/v1/completions",
                          "-H", "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, check=True).stdout
    events = [line[len("data: "):] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == \
        expected_text(reference, tokenizer, tokenizer.encode(PROMPTS[2]), 6)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    models = json.loads(subprocess.run(["curl", "-s", stack.http + "/v1/models"], capture_output=True, text=True,
                                       check=True).stdout)
    assert [m["id"] for m in models["data"]] == [DEFAULT_MODEL]
    health = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", stack.http + "/health"],
                            capture_output=True, text=True, check=True).stdout
    assert health == "200"


# ---- errors ----------------------------------------------------------------------------

def test_bad_requests_get_openai_errors_naming_the_field(client, stack):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=DEFAULT_MODEL, prompt="x", temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    assert "temperature must be >= 0" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=100_000)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=DEFAULT_MODEL, prompt="x", n=17)
    assert e.value.body["param"] == "n" and "n must be in [1, 16], got 17" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"guided_grammar": "root ::= \"x\""})
    assert e.value.body["param"] == "guided_grammar"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["param"] == "model"
    bad_json = httpx.post(stack.http + "/v1/completions", content=b"{not json",
                          headers={"Content-Type": "application/json"})
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    wrong_type = httpx.post(stack.http + "/v1/completions", json={"prompt": 5})
    assert wrong_type.status_code == 400 and wrong_type.json()["error"]["param"] == "prompt"


def test_a_gateway_without_workers_answers_503(stack, tmp_path):
    """A gateway on a Redis no worker registered with: /health and a completion are 503."""
    with RedisServer() as empty:
        argv = [*stack.argv["gateway"], "--redis-url", empty.url, "--http-port", str(free_port())]
        gateway, _ = start_process(argv, tmp_path / "gateway-alone.log")
        base = f"http://127.0.0.1:{argv[-1]}"
        try:
            deadline = time.monotonic() + 30
            while (health := httpx.get(base + "/health")).status_code != 503:  # its first check runs
                assert time.monotonic() < deadline, health.text
                time.sleep(0.2)
            # Unauthenticated, so a few fixed words, no registry (issue 36, point 12).
            assert health.json() == {"status": "unavailable", "reason": "no usable workers"}
            answer = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert answer.status_code == 503 and answer.json()["error"]["type"] == "service_unavailable"
            assert "cannot serve" in answer.json()["error"]["message"]
            empty.kill()  # and with its Redis gone: 503, without Redis's error text
            while (health := httpx.get(base + "/health")).json()["reason"] != "request store unreachable":
                assert time.monotonic() < deadline + 30, health.text
                time.sleep(0.2)
            assert health.status_code == 503 and health.json() == {"status": "unavailable",
                                                                   "reason": "request store unreachable"}
        finally:
            gateway.terminate()
            gateway.wait(30)


def test_a_gateway_whose_http_port_is_taken_exits_at_once_saying_so(stack, tmp_path):
    port = stack.http.rsplit(":", 1)[1]
    proc = subprocess.run([sys.executable, "-m", "splitserve.cli", *stack.argv["gateway"], "--http-port", port],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode != 0
    assert f"--http-port {port}: cannot listen on" in proc.stderr, proc.stderr[-2000:]


def test_token_and_queue_limit_on_a_second_gateway(stack, tmp_path):
    """401 without the bearer token (health stays open); 429 with Retry-After once the queue is full."""
    port = free_port()
    # A gateway with a client token needs an internal one too, and routes only to workers whose
    # registry records that token signed: the stack's workers, started without, are not among
    # them. One colocated worker with the token serves it.
    internal = {"SPLITSERVE_INTERNAL_TOKEN": TOKEN + "-internal"}
    decode = next(name for name, role in stack.roles.items() if role == "decode")
    worker, _ = start_process([*stack.argv[decode], "--role", "both", "--worker-id", f"both-token-{port}",
                               "--enforce-eager"], tmp_path / "worker-token.log", env=internal)
    gateway, _ = start_process([*stack.argv["gateway"], "--http-port", str(port), "--queue-limit", "1"],
                               tmp_path / "gateway-token.log", env={"SPLITSERVE_AUTH_TOKEN": TOKEN, **internal})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(base + "/health").status_code == 200, 30, "the token gateway to be ready")
        with openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0) as wrong:
            with pytest.raises(openai.AuthenticationError):
                wrong.models.list()
        # The tokenizer routes take the token as /v1 does; /version stays open, as /health.
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            assert httpx.post(base + path, json=body).status_code == 401
            assert httpx.post(base + path, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert httpx.post(base + path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        assert httpx.get(base + "/version").status_code == 200
        with openai.OpenAI(base_url=base + "/v1", api_key=TOKEN, max_retries=0) as right:
            assert [m.id for m in right.models.list().data] == [DEFAULT_MODEL]
            long = right.completions.create(model=DEFAULT_MODEL, prompt=PROMPTS[3], max_tokens=400, stream=True,
                                            **GREEDY)
            next(iter(long))  # the request holds the one place in the queue
            with pytest.raises(openai.RateLimitError) as e:
                right.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=2)
            assert int(e.value.response.headers["Retry-After"]) >= 1
            assert "queue full" in e.value.body["message"]
            long.close()
    finally:
        gateway.terminate()
        gateway.wait(30)
        worker.terminate()
        worker.wait(60)


# ---- vLLM's tokenizer routes, /version, the model's sampling defaults --------------------

def test_tokenize_and_detokenize_answer_as_vllms_do(stack, tokenizer):
    max_model_len = stack.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10).max_model_len
    ids = tokenizer.encode(PROMPTS[0])
    got = httpx.post(stack.http + "/tokenize", json={"model": DEFAULT_MODEL, "prompt": PROMPTS[0],
                                                     "return_token_strs": True})
    assert got.status_code == 200, got.text
    assert got.json() == {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                          "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    # A chat is rendered by the model's template with the generation prompt, as a chat completion is.
    messages = [{"role": "user", "content": "Name three colors."}]
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)
    chat = httpx.post(stack.http + "/tokenize", json={"messages": messages}).json()
    assert (chat["tokens"], chat["count"], chat["token_strs"]) == (chat_ids, len(chat_ids), None)
    # A template variable SmolLM2's template does not read is left out, as vLLM leaves it.
    unread = httpx.post(stack.http + "/tokenize", json={"messages": messages,
                                                        "chat_template_kwargs": {"enable_thinking": False}})
    assert unread.json()["tokens"] == chat_ids
    back = httpx.post(stack.http + "/detokenize", json={"model": DEFAULT_MODEL, "tokens": ids})
    assert back.status_code == 200 and back.json() == {"prompt": PROMPTS[0]}
    version = httpx.get(stack.http + "/version")
    assert version.status_code == 200 and version.json()["version"]


@pytest.mark.parametrize("path,body,status,param,words", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt", "either prompt"),
    ("/tokenize", {}, 400, "prompt", "either prompt"),
    ("/tokenize", {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools",
     "tools: only with messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 7 * 7 }}"}, 400,
     "chat_template", "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice",
     "needs a server started with --enable-auto-tool-choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto",
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice",
     "needs a server started with --enable-auto-tool-choice"),
    ("/v1/completions", {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools",
     "not supported"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model", "does not exist"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}}, 400,
     "chat_template_kwargs", "chat_template_kwargs.tools: set by the server"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": 1}},
     400, "chat_template_kwargs", "chat_template_kwargs.messages: set by the server"),
    ("/tokenize", {"prompt": 7}, 400, "prompt", ""),
    ("/detokenize", {"tokens": [49152]}, 400, "tokens", "tokens[0] is 49152, must be < vocab_size"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "tokens[0] must be a token id >= 0"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, None, "does not exist"),
])
def test_tokenizer_routes_refuse_bad_bodies_naming_the_field(stack, path, body, status, param, words):
    got = httpx.post(stack.http + path, json=body)
    assert got.status_code == status, got.text
    error = got.json()["error"]
    assert words in error["message"]
    if param is not None:
        assert error["param"] == param


def test_tools_documents_and_tool_turns_pass_through_the_template(stack, client, tokenizer, reference):
    """/tokenize renders tools, documents and a tool-call conversation as transformers'
    apply_chat_template does with the same objects; a chat completion takes them with
    tool_choice "none" and answers transformers' greedy tokens for that prompt."""
    tools = [{"type": "function", "function": {"name": "roll", "description": "Roll a die",
                                               "parameters": {"type": "object", "properties": {
                                                   "n": {"type": "integer", "maximum": 10}}}}}]
    documents = [{"title": "Dice", "text": "A die has six faces."}]
    messages = [{"role": "user", "content": "Roll one."},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "roll", "arguments": "{\"n\": 1}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
    rendered = [{**m, "content": m["content"] or ""} for m in messages]
    text = tokenizer.apply_chat_template(rendered, tools=tools, documents=documents, tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    got = httpx.post(stack.http + "/tokenize", json={"messages": messages, "tools": tools, "documents": documents})
    assert got.status_code == 200, got.text
    assert got.json()["tokens"] == ids
    answer = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, tools=tools, tool_choice="none",
                                            max_tokens=6, extra_body={"documents": documents, "ignore_eos": True},
                                            temperature=0)
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].message.content == expected_text(reference, tokenizer, ids, 6)


def test_a_gateway_takes_the_models_sampling_defaults(stack, tmp_path, tokenizer, reference):
    """--generation-config DIR: a generation_config.json whose temperature 0 and max_new_tokens 3
    fill a chat that leaves both unset, so its answer is transformers' greedy 3 tokens; a request
    that sets them is not changed."""
    generation = tmp_path / "generation"
    generation.mkdir()
    (generation / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    port = free_port()
    gateway, _ = start_process([*stack.argv["gateway"], "--http-port", str(port), "--generation-config",
                                str(generation)], tmp_path / "gateway-generation.log")
    base = f"http://127.0.0.1:{port}"
    messages = [{"role": "user", "content": "Name three colors."}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)
    try:
        wait_until(lambda: httpx.get(base + "/health").status_code == 200, 30, "the second gateway to be ready")
        with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0) as c:
            unset = c.chat.completions.create(model=DEFAULT_MODEL, messages=messages, extra_body={"ignore_eos": True})
            assert unset.usage.completion_tokens == 3
            assert unset.choices[0].message.content == expected_text(reference, tokenizer, ids, 3)
            own = c.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=5, **GREEDY)
            assert own.usage.completion_tokens == 5
    finally:
        gateway.terminate()
        gateway.wait(30)
    assert "sampling defaults from" in (tmp_path / "gateway-generation.log").read_text()


# ---- disconnects -----------------------------------------------------------------------

def _raw_post(http: str, path: str, body: dict) -> socket.socket:
    host, port = http.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _request(stack, request_id: str):
    return stack.stub.GetRequest(generation_pb2.GetRequestRequest(request_id=request_id), timeout=10)


def _request_states(stack, request_ids):
    """Their states in Redis ("" for one not admitted yet)."""
    states = []
    for request_id in request_ids:
        try:
            states.append(_request(stack, request_id).state)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            states.append("")
    return states


def test_clients_that_disconnect_abort_their_requests_on_every_worker(stack, baseline):
    """A stream closed after its first tokens, and a whole-answer request whose client hangs up
    while it runs: both end as aborted and every KV page comes back."""
    streamed = _raw_post(stack.http, "/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 1000, "stream": True,
                                                        "ignore_eos": True, "request_id": "http-gone-stream"})
    received = b""
    while received.count(b"data: ") < 3:
        received += streamed.recv(65536)
    whole = _raw_post(stack.http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story"}],
                                                          "max_tokens": 1000, "ignore_eos": True,
                                                          "request_id": "http-gone-whole"})
    deadline = time.monotonic() + 60
    while _request_states(stack, ["http-gone-whole"]) != ["decoding"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _request_states(stack, ["http-gone-whole"]) == ["decoding"]
    streamed.close()
    whole.close()
    while _request_states(stack, ["http-gone-stream", "http-gone-whole"]) != ["aborted", "aborted"]:
        assert time.monotonic() < deadline, _request_states(stack, ["http-gone-stream", "http-gone-whole"])
        time.sleep(0.05)
    wait_pages_at_baseline(stack, baseline)


def test_priority_reaches_the_queue(stack, client):
    client.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=2,
                              extra_body={"priority": 7, "request_id": "http-priority"})
    info = _request(stack, "http-priority")
    assert (info.priority, info.state) == (7, "finished")


def _raw_request(port: int, head: bytes, body: bytes = b"", timeout_s: float = 20.0) -> tuple[int, socket.socket]:
    """Send ``head`` (and ``body``) on a connection of its own; the answer's status and the socket."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sock.sendall(head + body)
    status_line = sock.makefile("rb").readline()
    return int(status_line.split()[1]), sock


def test_http_bodies_and_connections_are_bounded(stack, tmp_path, llama_reference):
    """Issue 36, point 4, with real clients: a body over --max-message-mb is refused with 413 while
    it is read (a declared length at once, a chunked one as it passes), one that dribbles in is
    cut with 408 after --http-body-timeout-s, and past --http-max-connections a request gets 503;
    requests within the bounds are served."""
    port = free_port()
    gateway, _ = start_process([*stack.argv["gateway"], "--http-port", str(port), "--max-message-mb", "0.01",
                                "--http-body-timeout-s", "1", "--http-max-connections", "3"],
                               tmp_path / "gateway-bounded.log")
    base = f"http://127.0.0.1:{port}"
    try:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n")
        status, sock = _raw_request(port, head % (8 << 30))  # 8 GB announced, nothing sent
        sock.close()
        assert status == 413
        chunks = (b" " * 4096 for _ in range(10))  # 40 KB, chunked: no length announced
        assert httpx.post(base + "/v1/completions", content=chunks, timeout=20).status_code == 413
        status, sock = _raw_request(port, head % 100, b'{"prompt": ')  # ... and the rest never comes
        sock.close()
        assert status == 408
        ok = httpx.post(base + "/v1/completions", timeout=60,
                        json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        try:
            assert httpx.get(base + "/health", timeout=20).status_code == 503
        finally:
            for sock in idle:
                sock.close()
        deadline = time.monotonic() + 20
        while httpx.get(base + "/health", timeout=20).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        gateway.terminate()
        gateway.wait(30)


def _answer_until_closed(sock: socket.socket, limit_s: float) -> bytes:
    """All the server sends on ``sock`` until it closes it; fails if it is still open after ``limit_s``."""
    got, deadline = b"", time.monotonic() + limit_s
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(4096)
        except socket.timeout:
            raise AssertionError(f"the server kept the connection open over {limit_s:g} s; it sent {got!r}") from None
        if not chunk:
            return got
        got += chunk


def test_http_request_headers_have_a_deadline(stack, tmp_path):
    """Issue 36, point 4 (slowloris): a connection that has not sent a whole request line and
    headers within --http-header-timeout-s is closed (from its start, or on a kept-alive
    connection from the previous response's end), with 408 if part of a request came, silently
    if nothing did; other connections are served meanwhile, and a request whose headers came in
    time may take longer for its body (that is --http-body-timeout-s's to bound)."""
    timeout_s, margin_s = 1.5, 20.0  # the margin: a loaded machine, not a speed requirement
    port = free_port()
    gateway, _ = start_process([*stack.argv["gateway"], "--http-port", str(port),
                                "--http-header-timeout-s", str(timeout_s), "--http-body-timeout-s", "60"],
                               tmp_path / "gateway-header-deadline.log")
    base = f"http://127.0.0.1:{port}"
    try:
        silent = socket.create_connection(("127.0.0.1", port))
        dribbling = socket.create_connection(("127.0.0.1", port))
        started = time.monotonic()
        dribbling.sendall(b"GET /health HTTP/1.1\r\n")
        # A header byte now and then, stopping well before the deadline (a byte sent after the
        # server closed could turn into a reset that hides its answer).
        while time.monotonic() - started < timeout_s - 0.5:
            dribbling.sendall(b"X")
            time.sleep(0.1)
        assert httpx.get(base + "/health", timeout=20).status_code == 200  # another connection is served
        answer = _answer_until_closed(dribbling, timeout_s + margin_s)
        assert answer.startswith(b"HTTP/1.1 408 ") and b"--http-header-timeout-s" in answer, answer
        assert _answer_until_closed(silent, timeout_s + margin_s) == b""
        # A kept-alive connection: its second request's headers have the same deadline.
        kept = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        kept.request("GET", "/health")
        first = kept.getresponse()
        assert first.status == 200 and not first.will_close
        first.read()
        kept.sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # ... and never the blank line
        assert _answer_until_closed(kept.sock, timeout_s + margin_s).startswith(b"HTTP/1.1 408 ")
        kept.close()
        # Headers in time, then the body well after the header deadline: served.
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "ignore_eos": True}).encode()
        late = socket.create_connection(("127.0.0.1", port), timeout=60)
        late.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        time.sleep(timeout_s + 1.0)
        late.sendall(body)
        assert late.makefile("rb").readline().split()[1] == b"200"
        late.close()
    finally:
        gateway.terminate()
        gateway.wait(30)


def test_a_bare_gateway_listens_on_loopback_and_an_open_one_says_so(stack, tmp_path):
    """Issue 36, point 12: without --host a gateway serves this machine only; told to serve every
    interface with neither TLS nor a client token, it says so in its log."""
    argv = list(stack.argv["gateway"])
    if "--http-port" in argv:  # (the stack's gateway holds its HTTP port)
        at = argv.index("--http-port")
        argv[at + 1] = "-1"
    at = argv.index("--host")
    bare = argv[:at] + argv[at + 2:]
    gateway, address = start_process(bare, tmp_path / "gateway-bare.log")
    try:
        assert address.startswith("127.0.0.1:")
    finally:
        gateway.terminate()
        gateway.wait(30)
    assert "neither TLS nor a client token" not in (tmp_path / "gateway-bare.log").read_text()
    gateway, _ = start_process(argv[:at] + ["--host", "0.0.0.0"] + argv[at + 2:], tmp_path / "gateway-open.log")
    try:
        assert "the gateway serves 0.0.0.0 with neither TLS nor a client token" in \
            (tmp_path / "gateway-open.log").read_text()
    finally:
        gateway.terminate()
        gateway.wait(30)
