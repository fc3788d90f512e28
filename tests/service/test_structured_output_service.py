"""Structured output through a real disaggregated stack (Redis, gateway, one prefill and one
decode worker) serving SmolLM2 in fp32: the prefill worker samples the first token under the
grammar, the decode worker replays it and constrains the rest. Through gRPC and through the
OpenAI HTTP API (the ``openai`` package); invalid schemas and regexes are refused at the edge."""
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from splitserve.engine.model_loader import DEFAULT_MODEL
from tests.harness.schemas import PERSON_SCHEMA
from splitserve.v1 import generation_pb2

pytestmark = pytest.mark.slow

SCHEMA = PERSON_SCHEMA
NAMES = ["Alice", "Bob", "Chen", "Dmitri", "Eve", "Fatima"]


@pytest.fixture(scope="module")
def stack(smollm2_stack):
    return smollm2_stack


@pytest.fixture(scope="module")
def client(openai_client):
    return openai_client


def ask(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Write a JSON record for a user called {name}: name, age and city."}]


def test_grpc_json_schema_concurrent_requests_validate(stack):
    spec = generation_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))

    def one(name):
        return stack.client.complete(messages=ask(name), max_tokens=48, temperature=0.0, structured_output=spec)

    with ThreadPoolExecutor(len(NAMES)) as pool:  # concurrent: they share the decode worker's batch
        results = list(pool.map(one, NAMES))
    for text, last in results:
        assert last.finish_reason == "eos", (text, last)
        jsonschema.validate(json.loads(text), SCHEMA)
    info = stack.client.get_request(results[0][1].request_id)
    assert info.timeline.prefill_worker and info.timeline.decode_worker  # the handoff path ran


def test_grpc_choice_and_regex(stack):
    text, _ = stack.client.complete(messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=8,
                                    temperature=0.0, structured_output=generation_pb2.StructuredOutput(
                                        choice=generation_pb2.StringList(values=["yes", "no"])))
    assert text in ("yes", "no")
    text, _ = stack.client.complete(messages=[{"role": "user", "content": "A ticket code please."}],
                                    max_tokens=20, temperature=0.0,
                                    structured_output=generation_pb2.StructuredOutput(regex=r"[A-Z]{2}-[0-9]{4}"))
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", text), text


def test_grpc_invalid_schema_is_invalid_argument_naming_the_field(stack):
    for spec, field in ((generation_pb2.StructuredOutput(json_schema='{"type": "strin"}'), "json_schema"),
                        (generation_pb2.StructuredOutput(regex="(ab"), "regex")):
        with pytest.raises(grpc.RpcError) as e:
            stack.client.complete("x", max_tokens=4, structured_output=spec)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"sampling.structured_output.{field}" in e.value.details()


def test_openai_response_format_json_schema_and_json_object(client):
    for name in NAMES[:3]:
        out = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=ask(name), max_tokens=48, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA}})
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    out = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "A cat as JSON."}],
                                         max_tokens=64, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_openai_vllm_guided_fields(client):
    out = client.completions.create(model=DEFAULT_MODEL, prompt="Is water wet? Answer:", max_tokens=8, temperature=0,
                                    extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].text in ("yes", "no")
    out = client.completions.create(model=DEFAULT_MODEL, prompt="My zip code is", max_tokens=8, temperature=0,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{5}"}})
    assert re.fullmatch("[0-9]{5}", out.choices[0].text)
    out = client.completions.create(model=DEFAULT_MODEL, prompt="User record:", max_tokens=48, temperature=0,
                                    extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)


def test_openai_refusals(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "(ab"})
    assert "structured_output.regex" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "a", "guided_choice": ["a"]})
    assert "only one structured-output constraint" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert e.value.body["param"] == "response_format"


def test_a_deeply_nested_schema_is_refused_before_it_compiles(stack, client):
    """Issue 36, point 1: 300 levels of {"type": "array", "items": ...} (8 KB) compile for a long
    time; the gateway refuses them by their depth, before its checker or any worker sees them:
    INVALID_ARGUMENT / HTTP 400 naming the field and the flag."""
    schema = {"type": "string"}
    for _ in range(300):
        schema = {"type": "array", "items": schema}
    with pytest.raises(grpc.RpcError) as err:
        stack.client.complete("x", max_tokens=4,
                              structured_output=generation_pb2.StructuredOutput(json_schema=json.dumps(schema)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_output.json_schema nests 301 levels" in err.value.details()
    assert "--max-schema-depth" in err.value.details()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=4, extra_body={"guided_json": schema})
    assert "--max-schema-depth" in e.value.body["message"]


def test_the_gateway_never_loads_torch_and_checks_grammars_in_a_child(stack):
    """After the requests above (schemas, regexes, refusals), the gateway's own address space
    still holds no torch: it tokenized without it and left every grammar to its checker child,
    which loaded the grammar library (and torch with it)."""
    import psutil

    gateway = psutil.Process(stack.procs["gateway"].pid)
    assert not [m.path for m in gateway.memory_maps() if "libtorch" in m.path]
    [checker] = [c for c in gateway.children() if "splitserve.engine.grammar_server" in " ".join(c.cmdline())]
    assert [m.path for m in checker.memory_maps() if "libtorch" in m.path]


def test_a_slow_grammar_compiles_beside_the_decode_batch(stack):
    """Issue 36, point 1: a regex that the gateway's check parses at once but that takes seconds
    to compile against the vocabulary ([^x]{1,3000}: ~2 s here) is compiled by the workers beside
    their engine threads (the decode worker from its Reserve on, while the prompt is prefilled), so
    a bystander decoding on the same worker keeps getting tokens: before, the decode worker
    compiled it between two steps of the bystander, which then got nothing for the whole compile."""
    spec = generation_pb2.StructuredOutput(regex=f"[^x]{{1,{3000 + int(time.time()) % 1000}}}")  # a new one
    arrivals: list[float] = []
    started, slow_window = threading.Event(), []

    def bystander():
        for event in stack.client.generate("Tell me a long story about the sea.", max_tokens=120, min_tokens=120,
                                           temperature=0.0, timeout=120):
            if event.token_ids:
                arrivals.append(time.monotonic())
                if len(arrivals) == 5:
                    started.set()

    def slow():
        assert started.wait(60)
        begin = time.monotonic()
        text, last = stack.client.complete("Say something.", max_tokens=4, temperature=0.0, structured_output=spec,
                                           timeout=120)
        slow_window.extend([begin, time.monotonic()])
        return text, last

    with ThreadPoolExecutor(2) as pool:
        streaming = pool.submit(bystander)
        text, last = pool.submit(slow).result()
        streaming.result()
    assert last.finish_reason == "length" and "x" not in text, (text, last)
    begin, end = slow_window
    during = [t for t in arrivals if begin <= t <= end]
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert end - begin > 1.0, "the grammar compiled too fast to show anything"
    # Compiled between two of the bystander's steps, the grammar stopped it for the whole compile
    # (the gap was the request's time); beside them, at a lower CPU priority, it keeps streaming. The
    # bound is relative: on a loaded 2-core box a step itself may take a few hundred ms.
    print(f"longest gap {max(gaps, default=0):.2f} s while the {end - begin:.1f} s request ran")
    assert len(during) > 3 and max(gaps) < 0.5 * (end - begin), (
        f"the bystander got no token for {max(gaps, default=0):.2f} s while the {end - begin:.1f} s request ran")
