"""Proto <-> domain conversion and the error -> gRPC status mapping (no model needed)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading

import grpc
import pytest
from google.protobuf import json_format

from splitserve.engine.sampling_params import SamplingParams
from splitserve.kvtransfer.base import (KVLayout, LayoutMismatchError, StaleEpochError, TransferDescriptor,
                             TransferError)
from splitserve import wire
from splitserve.worker import descriptors
from splitserve.common import errors
from splitserve.common.limits import RequestLimits
from splitserve.v1 import generation_pb2 as pb
from splitserve.v1 import worker_pb2


# ---- sampling --------------------------------------------------------------------------

def test_sampling_defaults():
    engine_default = SamplingParams()
    for msg in (None, pb.SamplingParams()):
        p = wire.sampling_from_proto(msg)
        assert p.max_tokens == wire.DEFAULT_MAX_TOKENS == 256
        assert p.temperature == wire.DEFAULT_TEMPERATURE == 1.0
        for name in ("min_tokens", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
                     "frequency_penalty", "presence_penalty", "logprobs", "stop", "stop_token_ids",
                     "ignore_eos"):
            assert getattr(p, name) == getattr(engine_default, name), name


def test_sampling_set_fields_and_zero_values():
    msg = json_format.Parse(
        '{"max_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "seed": 0,'
        ' "min_tokens": 0, "repetition_penalty": 1.2, "frequency_penalty": 0.0, "presence_penalty": 0.3,'
        ' "stop": ["###"], "stop_token_ids": [7], "ignore_eos": true, "logprobs": 0}', pb.SamplingParams())
    p = wire.sampling_from_proto(msg)
    assert p.max_tokens == 5
    assert p.temperature == 0.0 and p.is_greedy  # explicit 0 is greedy, not the default 1.0
    assert (p.top_p, p.top_k, p.min_p, p.seed, p.min_tokens) == (0.5, 3, 0.1, 0, 0)
    assert (p.repetition_penalty, p.presence_penalty) == (1.2, 0.3)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == (["###"], [7], True, 0)


def test_sampling_top_k_minus_one_means_off():
    assert wire.sampling_from_proto(pb.SamplingParams(top_k=-1)).top_k == 0


@pytest.mark.parametrize("fields, field_path", [
    ({"temperature": -1.0}, "sampling.temperature"),
    ({"temperature": math.nan}, "sampling.temperature"),
    ({"top_k": -2}, "sampling.top_k"),
    ({"top_p": 0.0}, "sampling.top_p"),
    ({"top_p": 1.5}, "sampling.top_p"),
    ({"min_p": 2.0}, "sampling.min_p"),
    ({"max_tokens": 0}, "sampling.max_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "sampling.min_tokens"),
    ({"repetition_penalty": 0.0}, "sampling.repetition_penalty"),
    ({"frequency_penalty": 3.0}, "sampling.frequency_penalty"),
    ({"presence_penalty": -2.5}, "sampling.presence_penalty"),
    ({"logprobs": 21}, "sampling.logprobs"),
    ({"stop": [""]}, "sampling.stop"),
])
def test_sampling_invalid_names_field(fields, field_path):
    with pytest.raises(errors.InvalidArgument) as info:
        wire.sampling_from_proto(pb.SamplingParams(**fields))
    assert str(info.value).startswith(field_path + " "), str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    assert errors.status_for(info.value)[0] == grpc.StatusCode.INVALID_ARGUMENT


# ---- resolved once at the edge -----------------------------------------------------------

def test_resolve_sampling_checks_prompt_plus_max_tokens_against_the_model():
    ok = wire.resolve_sampling(pb.SamplingParams(max_tokens=24), num_prompt_tokens=1000, max_model_len=1024)
    assert ok.max_tokens == 24
    with pytest.raises(errors.InvalidArgument) as info:
        wire.resolve_sampling(pb.SamplingParams(max_tokens=25), num_prompt_tokens=1000, max_model_len=1024)
    assert str(info.value).startswith("sampling.max_tokens") and "max_model_len (1024)" in str(info.value)
    assert "at most 24" in str(info.value)
    with pytest.raises(errors.InvalidArgument, match="max_model_len is 1024"):
        wire.resolve_sampling(pb.SamplingParams(), num_prompt_tokens=1024, max_model_len=1024)
    # Unset: the default, or the room the prompt leaves if that is less.
    assert wire.resolve_sampling(pb.SamplingParams(), 10, 1024).max_tokens == wire.DEFAULT_MAX_TOKENS
    assert wire.resolve_sampling(pb.SamplingParams(), 1000, 1024).max_tokens == 24
    with pytest.raises(errors.InvalidArgument, match="sampling.min_tokens"):
        wire.resolve_sampling(pb.SamplingParams(min_tokens=30), 1000, 1024)


def test_the_models_sampling_defaults_fill_only_what_a_request_leaves_unset():
    """A model's generation_config.json defaults (``--generation-config auto``) come before the
    server's own; a request's own values win over both; a default max_tokens is capped by the
    room the prompt leaves, as the server's is."""
    model = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 40}
    unset = wire.resolve_sampling(pb.SamplingParams(), 10, 1024, model)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty, unset.max_tokens) == (
        0.6, 0.9, 20, 1.1, 40)
    assert unset.min_p == 0.0  # not in the file: the engine's
    own = wire.resolve_sampling(pb.SamplingParams(temperature=0, top_p=1.0, max_tokens=7), 10, 1024, model)
    assert (own.temperature, own.top_p, own.top_k, own.max_tokens) == (0.0, 1.0, 20, 7)
    assert wire.resolve_sampling(pb.SamplingParams(), 1000, 1024, model).max_tokens == 24
    server = wire.resolve_sampling(pb.SamplingParams(), 10, 1024, {})
    assert (server.temperature, server.top_p, server.max_tokens) == (wire.DEFAULT_TEMPERATURE, 1.0,
                                                                     wire.DEFAULT_MAX_TOKENS)
    wire.check_sampling_defaults(model)
    with pytest.raises(ValueError, match="temperature"):
        wire.check_sampling_defaults({"temperature": -1})
    with pytest.raises(ValueError, match="top_p"):
        wire.check_sampling_defaults({"top_p": 1.5})


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(max_tokens=7, min_tokens=2, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=2**64 - 1,
                   repetition_penalty=1.3, frequency_penalty=-0.5, presence_penalty=0.25, ignore_eos=True,
                   stop_token_ids=[3, 9], logprobs=0),
    SamplingParams(seed=0, logprobs=20, stop=["ignored by workers"]),
])
def test_resolved_sampling_reaches_workers_unchanged(params):
    """Every field crosses to the worker as the gateway resolved it (stop strings stay at the
    gateway); a worker applies no default of its own."""
    msg = worker_pb2.ResolvedSampling.FromString(wire.sampling_to_worker(params).SerializeToString())
    back = wire.sampling_from_worker(msg)
    for field in dataclasses.fields(SamplingParams):
        if field.name != "stop":
            assert getattr(back, field.name) == getattr(params, field.name), field.name
    assert back.stop == []


def test_a_worker_refuses_unresolved_sampling_instead_of_defaulting():
    with pytest.raises(errors.InvalidArgument, match="max_tokens must be >= 1"):
        wire.sampling_from_worker(worker_pb2.ResolvedSampling())  # nothing set: max_tokens 0


# ---- prompt ----------------------------------------------------------------------------

def test_prompt_forms():
    assert wire.prompt_from_request(pb.GenerateRequest(text="hi")) == ("text", "hi")
    assert wire.prompt_from_request(pb.GenerateRequest(token_ids=[1, 2])) == ("token_ids", [1, 2])
    req = json_format.Parse('{"messages":[{"role":"system","content":""},{"role":"user","content":"hi"}]}',
                            pb.GenerateRequest())
    assert wire.prompt_from_request(req) == (
        "messages", [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}])
    assert wire.prompt_from_request(pb.TokenizeRequest(text="x")) == ("text", "x")


@pytest.mark.parametrize("req", [
    pb.GenerateRequest(),
    pb.GenerateRequest(text=""),
    pb.GenerateRequest(token_ids=[]),
    pb.GenerateRequest(text="hi", token_ids=[1]),
    pb.GenerateRequest(text="hi", messages=[pb.ChatMessage(role="user", content="x")]),
    pb.GenerateRequest(token_ids=[1], messages=[pb.ChatMessage(role="user", content="x")]),
])
def test_prompt_exactly_one(req):
    with pytest.raises(errors.InvalidArgument, match="exactly one of text, token_ids, messages must be set"):
        wire.prompt_from_request(req)


def test_tokenize_request_lists_its_own_fields():
    with pytest.raises(errors.InvalidArgument, match="^exactly one of text, messages must be set"):
        wire.prompt_from_request(pb.TokenizeRequest())


def test_prompt_empty_role_and_vocab():
    req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="a"), pb.ChatMessage(content="b")])
    with pytest.raises(errors.InvalidArgument, match=r"messages\[1\]\.role"):
        wire.prompt_from_request(req)
    with pytest.raises(errors.InvalidArgument, match=r"token_ids\[1\] is 10, must be < vocab_size \(10\)"):
        wire.prompt_from_request(pb.GenerateRequest(token_ids=[9, 10]), vocab_size=10)
    assert wire.prompt_from_request(pb.GenerateRequest(token_ids=[9]), vocab_size=10) == ("token_ids", [9])


# ---- descriptor and logprobs -----------------------------------------------------------

def _descriptor(**overrides) -> TransferDescriptor:
    kwargs = dict(request_id="req-1", transport="shm", address="/dev/shm/splitserve-x",
                  block_ids=(4, 5, 9), layout=KVLayout("tiny-llama", 2, 3, 16, 16, "bfloat16"),
                  epoch=2**40 + 3, lease_deadline=1_700_000_000.25,
                  alternatives=(("tcp", "127.0.0.1:5000"), ("nccl", "10.0.0.2:6000")))
    kwargs.update(overrides)
    return TransferDescriptor(**kwargs)


@pytest.mark.parametrize("desc", [_descriptor(), _descriptor(alternatives=(), block_ids=(0,), epoch=0),
                                  _descriptor(layout=KVLayout("tiny-llama", 2, 3, 16, 16, "float32",
                                                              page_order="head_major"))])
def test_descriptor_round_trip(desc):
    msg = descriptors.descriptor_to_proto(desc)
    received = worker_pb2.TransferDescriptor.FromString(msg.SerializeToString())
    back = descriptors.descriptor_from_proto(received)
    assert back == desc
    assert back.offers == desc.offers


def test_descriptor_from_proto_rejects_incomplete():
    msg = descriptors.descriptor_to_proto(_descriptor())
    msg.ClearField("layout")
    with pytest.raises(errors.InvalidArgument, match=r"descriptor\.layout must be set"):
        descriptors.descriptor_from_proto(msg)
    msg = descriptors.descriptor_to_proto(_descriptor())
    msg.transport = ""
    with pytest.raises(errors.InvalidArgument, match=r"descriptor\.transport must be set"):
        descriptors.descriptor_from_proto(msg)


def test_logprobs_round_trip():
    entry = [(42, -0.25), (42, -0.25), (7, -1.5), (3, float("-inf"))]
    msg = wire.logprobs_to_proto(entry)
    assert (msg.token_id, msg.logprob) == (42, -0.25)
    assert [(t.token_id, t.logprob) for t in msg.top] == entry[1:]
    assert wire.logprobs_from_proto(pb.TokenLogprobs.FromString(msg.SerializeToString())) == entry
    assert wire.logprobs_to_proto(None) is None
    assert wire.logprobs_from_proto(None) is None
    only_sampled = wire.logprobs_to_proto([(5, -0.1)])
    assert (only_sampled.token_id, list(only_sampled.top)) == (5, [])
    assert "-Infinity" in json_format.MessageToJson(msg)


# ---- sizes -----------------------------------------------------------------------------

LIMITS = RequestLimits(max_prompt_bytes=100, max_messages=3, max_stop_sequences=2, max_stop_bytes=8,
                       max_stop_token_ids=4, max_request_id_bytes=10, max_grammar_bytes=64, max_schema_depth=4)
MAX_MODEL_LEN = 50


def generate(**kw) -> pb.GenerateRequest:
    return json_format.ParseDict(kw, pb.GenerateRequest())


@pytest.mark.parametrize("request_fields", [
    {"request_id": "x" * 10, "text": "a" * 100},
    {"request_id": "é" * 5, "text": "é" * 50},  # 2 bytes per character: exactly at the limits
    {"token_ids": list(range(MAX_MODEL_LEN - 1))},
    {"messages": [{"role": "user", "content": "a" * 46}, {"role": "assistant", "content": ""},
                  {"role": "user", "content": "b" * 31}]},
    {"text": "hi", "sampling": {"stop": ["12345678", "é" * 4], "stop_token_ids": [1, 2, 3, 4]}},
    {"text": "hi", "sampling": {"structured_output": {"regex": "a" * 64}}},
    {"text": "hi", "sampling": {"structured_output": {"choice": {"values": ["a" * 32, "é" * 16]}}}},
    # Four levels; brackets inside strings do not count.
    {"text": "hi", "sampling": {"structured_output": {"json_schema": '{"a": {"b": [{"c": "[[{{"}]}}'}}},
])
def test_sizes_at_the_limits_pass(request_fields):
    wire.check_sizes(generate(**request_fields), LIMITS, MAX_MODEL_LEN)


@pytest.mark.parametrize("request_fields, field_path, flag", [
    ({"request_id": "x" * 11, "text": "a"}, "request_id is 11 characters", "--max-request-id-bytes"),
    ({"request_id": "é" * 6, "text": "a"}, "request_id is 12 bytes", "--max-request-id-bytes"),
    ({"text": "a" * 101}, "text is 101 characters", "--max-prompt-bytes"),
    ({"text": "é" * 51}, "text is 102 bytes", "--max-prompt-bytes"),
    ({"token_ids": list(range(MAX_MODEL_LEN))}, "token_ids has 50 tokens", "max_model_len is 50"),
    ({"messages": [{"role": "user", "content": "a"}] * 4}, "messages has 4 entries", "--max-messages"),
    ({"messages": [{"role": "user", "content": "a" * 46}, {"role": "assistant", "content": "b" * 45}]},
     "messages: their roles and contents up to messages[1]", "--max-prompt-bytes"),
    ({"messages": [{"role": "u" * 101, "content": ""}]}, "messages: their roles and contents up to messages[0]",
     "--max-prompt-bytes"),
    ({"text": "a", "sampling": {"stop": ["a", "b", "c"]}}, "sampling.stop has 3 strings", "--max-stop-sequences"),
    ({"text": "a", "sampling": {"stop": ["a", "123456789"]}}, "sampling.stop[1] is 9 characters",
     "--max-stop-bytes"),
    ({"text": "a", "sampling": {"stop_token_ids": [1] * 5}}, "sampling.stop_token_ids has 5 ids",
     "--max-stop-token-ids"),
    # Issue 36, point 1: a spec's size and a schema's depth, before anything compiles it.
    ({"text": "a", "sampling": {"structured_output": {"regex": "a" * 65}}},
     "sampling.structured_output.regex is 65 characters", "--max-grammar-bytes"),
    ({"text": "a", "sampling": {"structured_output": {"json_schema": '{"enum": ["' + "é" * 30 + '"]}'}}},
     "sampling.structured_output.json_schema is 74 bytes", "--max-grammar-bytes"),
    ({"text": "a", "sampling": {"structured_output": {"choice": {"values": ["a" * 40, "b" * 40]}}}},
     "sampling.structured_output.choice: its strings together", "--max-grammar-bytes"),
    ({"text": "a", "sampling": {"structured_output": {"json_schema": '{"items": {"items": {"items": [{}]}}}'}}},
     "sampling.structured_output.json_schema nests 5 levels", "--max-schema-depth"),
])
def test_sizes_over_a_limit_are_invalid_argument_naming_field_and_flag(request_fields, field_path, flag):
    with pytest.raises(errors.InvalidArgument) as err:
        wire.check_sizes(generate(**request_fields), LIMITS, MAX_MODEL_LEN)
    assert str(err.value).startswith(field_path.split(" ")[0]) and field_path in str(err.value)
    assert flag in str(err.value)


def test_tokenize_request_sizes_are_checked_too():
    wire.check_sizes(pb.TokenizeRequest(text="a" * 100), LIMITS, MAX_MODEL_LEN)
    for request in (pb.TokenizeRequest(text="a" * 101),
                    pb.TokenizeRequest(messages=[pb.ChatMessage(role="user", content="a")] * 4)):
        with pytest.raises(errors.InvalidArgument):
            wire.check_sizes(request, LIMITS, MAX_MODEL_LEN)


def test_a_huge_text_is_refused_without_being_encoded():
    # Its character count already says it is too long: measuring it in bytes would copy it.
    class Text(str):
        def encode(self, *args, **kwargs):
            raise AssertionError("encoded")
    with pytest.raises(errors.InvalidArgument):
        wire._check_bytes("text", Text("a" * 1000), 100, "--max-prompt-bytes")


# ---- status mapping --------------------------------------------------------------------

@pytest.mark.parametrize("exc, code", [
    (errors.InvalidArgument("bad"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.AlreadyExists("taken"), grpc.StatusCode.ALREADY_EXISTS),
    (errors.ResourceExhausted("full", retry_after_s=1), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.NotFound("nope"), grpc.StatusCode.NOT_FOUND),
    (errors.Cancelled("gone"), grpc.StatusCode.CANCELLED),
    (errors.DeadlineExceeded("late"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Unavailable("down"), grpc.StatusCode.UNAVAILABLE),
    (ValueError("temperature must be >= 0"), grpc.StatusCode.INVALID_ARGUMENT),
    (LayoutMismatchError("KV layout mismatch"), grpc.StatusCode.FAILED_PRECONDITION),
    (StaleEpochError("stale epoch"), grpc.StatusCode.UNAVAILABLE),
    (TransferError("peer gone"), grpc.StatusCode.UNAVAILABLE),
])
def test_status_for_known(exc, code):
    assert errors.status_for(exc) == (code, str(exc))


def test_status_for_unexpected_is_internal_and_logged(caplog):
    try:
        raise KeyError("secret-internal-detail")
    except KeyError as exc:
        with caplog.at_level(logging.ERROR, logger="splitserve.common.errors"):
            code, message = errors.status_for(exc)
    assert code == grpc.StatusCode.INTERNAL
    assert "secret" not in message and message == errors.INTERNAL_MESSAGE
    assert any(r.exc_info and "secret-internal-detail" in r.exc_text for r in caplog.records)


def test_resource_exhausted_retry_after_validated():
    assert errors.ResourceExhausted("x").retry_after_s is None
    with pytest.raises(ValueError):
        errors.ResourceExhausted("x", retry_after_s=-1)


# ---- interceptor on a real (asyncio) server ---------------------------------------------

def _raise(exc):
    async def handler(request, context):
        raise exc
    return handler


def _raise_streaming(exc):
    async def handler(request, context):
        raise exc
        yield  # an async generator, as streaming handlers are
    return handler


async def _echo(request, context):
    return request


async def _stream_then_raise(request, context):
    yield b"one"
    yield b"two"
    raise errors.Unavailable("decode worker went away")


async def _abort_itself(request, context):
    await context.abort(grpc.StatusCode.PERMISSION_DENIED, "handler chose this")


@pytest.fixture(scope="module")
def channel():
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(_echo),
        "Invalid": grpc.unary_unary_rpc_method_handler(_raise(errors.InvalidArgument("sampling.top_p must be in (0, 1]"))),
        "Full": grpc.unary_unary_rpc_method_handler(_raise(errors.ResourceExhausted("queue full", retry_after_s=1.5))),
        "FullNoHint": grpc.unary_unary_rpc_method_handler(_raise(errors.ResourceExhausted("queue full"))),
        "EngineValue": grpc.unary_unary_rpc_method_handler(_raise(ValueError("max_tokens must be >= 1, got 0"))),
        "Layout": grpc.unary_unary_rpc_method_handler(_raise(LayoutMismatchError("KV layout mismatch"))),
        "Bug": grpc.unary_unary_rpc_method_handler(_raise(ZeroDivisionError("secret-internal-detail"))),
        "Aborts": grpc.unary_unary_rpc_method_handler(_abort_itself),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream_then_raise),
        "StreamNotFound": grpc.unary_stream_rpc_method_handler(_raise_streaming(errors.NotFound("no request r1"))),
    }
    started, port = threading.Event(), []
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def serve():
        server = grpc.aio.server(interceptors=[errors.ErrorMappingInterceptor()])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Errors", handlers),))
        port.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        started.set()
        await stop.wait()
        await server.stop(grace=None)
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(30)
    with grpc.insecure_channel(f"127.0.0.1:{port[0]}") as ch:
        yield ch
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)


def _call(channel, method) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(f"/test.Errors/{method}")(b"x", timeout=10)
    return info.value


def test_interceptor_passes_success(channel):
    assert channel.unary_unary("/test.Errors/Echo")(b"ping", timeout=10) == b"ping"


@pytest.mark.parametrize("method, code, details", [
    ("Invalid", grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p must be in (0, 1]"),
    ("EngineValue", grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1, got 0"),
    ("Layout", grpc.StatusCode.FAILED_PRECONDITION, "KV layout mismatch"),
    ("Bug", grpc.StatusCode.INTERNAL, errors.INTERNAL_MESSAGE),
    ("Aborts", grpc.StatusCode.PERMISSION_DENIED, "handler chose this"),
])
def test_interceptor_maps_unary(channel, method, code, details):
    err = _call(channel, method)
    assert (err.code(), err.details()) == (code, details)


def test_interceptor_retry_after(channel):
    err = _call(channel, "Full")
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (errors.RETRY_AFTER_METADATA_KEY, "1500") in tuple(err.trailing_metadata())
    err = _call(channel, "FullNoHint")
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert errors.RETRY_AFTER_METADATA_KEY not in dict(err.trailing_metadata() or ())


def test_interceptor_maps_stream_after_messages(channel):
    got = []
    with pytest.raises(grpc.RpcError) as info:
        for message in channel.unary_stream("/test.Errors/Stream")(b"x", timeout=10):
            got.append(message)
    assert got == [b"one", b"two"]
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAVAILABLE, "decode worker went away")
    with pytest.raises(grpc.RpcError) as info:
        list(channel.unary_stream("/test.Errors/StreamNotFound")(b"x", timeout=10))
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.NOT_FOUND, "no request r1")


def test_a_struct_comes_back_with_sorted_keys_and_whole_numbers():
    """A protobuf Struct keeps no key order and iterates its map in an order that changes from
    process to process: tools sent over gRPC rendered a different chat prompt in each gateway.
    They come back sorted at every level (26 keys: an unsorted order passing by chance is out of
    the question), whole numbers as ints."""
    from google.protobuf import struct_pb2
    letters = [chr(c) for c in range(ord("z"), ord("a") - 1, -1)]
    sent = {k: {"inner": {j: 1.0 for j in letters}, "n": 3.0, "x": 0.5} for k in letters}
    struct = struct_pb2.Struct()
    struct.update(sent)
    back = wire.struct_to_python(struct)
    assert list(back) == sorted(letters)
    assert all(list(v) == ["inner", "n", "x"] and list(v["inner"]) == sorted(letters) for v in back.values())
    assert back["q"]["n"] == 3 and type(back["q"]["n"]) is int and back["q"]["x"] == 0.5
