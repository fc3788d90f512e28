"""Hypothesis strategies for every public request message, and how to call and describe one.

Shared by the property-based test of the API (``tests/faults/test_fuzz_api.py``) and the long
fuzz run (``bench/fuzz.py``). The strategies build wild values: NaN/inf/huge/negative floats,
integers at their wire-type bounds, unicode and NUL bytes, huge prompts and stop lists,
out-of-vocabulary token ids, several prompt kinds at once, request ids with odd characters,
fields far past the gateway's size limits (millions of stop token ids, token ids or chat
messages, megabyte stop strings and ids). Every answer must be OK or a precise client-error
status (``ALLOWED``). ``oversized_requests`` builds requests that are legal but for one field
just or far past its limit; those must be INVALID_ARGUMENT naming that field.

A Generate that is accepted is read for at most ``READ_BUDGET`` (messages and seconds), then
cancelled by the client: huge ``max_tokens`` must not make a run slow, and the cut exercises
the cancel path too. ``stalled_call`` is the other careless client: it stops reading for a
while (a 1 KiB window, so the gateway's sends block), then reads on.
"""
from __future__ import annotations

import json
import math
import time

import grpc
from hypothesis import strategies as st

from splitserve.common.limits import RequestLimits
from splitserve.v1 import generation_pb2

# Answers a client can cause with its input; anything else is a server bug.
CLIENT_ERRORS = frozenset({"INVALID_ARGUMENT", "NOT_FOUND", "OUT_OF_RANGE", "RESOURCE_EXHAUSTED",
                           "FAILED_PRECONDITION", "ALREADY_EXISTS"})
ALLOWED = CLIENT_ERRORS | {"OK"}
# A Generate stream is read for at most this many messages / seconds, then cancelled ("OK (cut)").
READ_BUDGET = (16, 3.0)
RPC_TIMEOUT_S = 30.0

# A Mistral-style template that rejects conversations it cannot render, as many real models'
# templates do (raise_exception is transformers' hook for that).
CHAT_TEMPLATE = (
    "{% set offset = 1 if messages and messages[0]['role'] == 'system' else 0 %}"
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% if message['role'] == 'system' and loop.index0 > 0 %}"
    "{{ raise_exception('a system message must come first') }}{% endif %}"
    "{% if message['role'] != 'system' and (message['role'] == 'user') != ((loop.index0 - offset) % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '[' + message['role'] + '] ' + message['content'] + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}"
)

# ---- strategies ------------------------------------------------------------------------------

UINT32_MAX, INT32_MIN, INT32_MAX, UINT64_MAX = 2**32 - 1, -(2**31), 2**31 - 1, 2**64 - 1

wild_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e-6, 1e-5, 0.1, 0.5, 0.999999, 1.0, 1.0000001, 2.0, 2.5, 100.0,
                     1e300, -1.0, -2.0, -1e-300, math.nan, math.inf, -math.inf]),
)
# Mostly in-range values (so requests get past validation and run), often the edges.
sane_floats = st.floats(min_value=0.0, max_value=2.0, allow_nan=False)
some_floats = st.one_of(sane_floats, wild_floats)
uint32 = st.one_of(st.integers(0, 8), st.integers(0, UINT32_MAX), st.sampled_from([2**31 - 1, 2**31, UINT32_MAX]))
int32 = st.one_of(st.integers(-2, 64), st.integers(INT32_MIN, INT32_MAX),
                  st.sampled_from([INT32_MIN, INT32_MIN + 1, -1, 0, 1, INT32_MAX]))
uint64 = st.one_of(st.integers(0, 1000), st.integers(0, UINT64_MAX), st.sampled_from([2**63 - 1, 2**63, UINT64_MAX]))
# Any unicode proto3 can carry (UTF-8: no lone surrogates), NUL and control characters included.
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
big_texts = st.sampled_from([2_000, 100_000, 5_000_000]).map(lambda n: "é" * (n // 2))
odd_ids = st.one_of(st.just(""), texts, st.sampled_from([
    "{ss}", "{ss}:q:pending", "*", "?", "[a-z]", "a:b", "req:x", " ", "\n", "\x00", "../../etc", "é🙂",
    "x" * 10_000]))
token_id = st.one_of(st.integers(0, 258), st.integers(0, UINT32_MAX), st.sampled_from([258, 259, UINT32_MAX]))
# Lists far past any limit are built whole (hypothesis would draw a million elements one by one).
def _many(item, sizes):
    return st.sampled_from(sizes).map(lambda n: [item] * n)


token_lists = st.one_of(st.lists(token_id, max_size=40), st.just(list(range(256)) * 5),
                        _many(7, [1024, 2_000_000]))
roles = st.one_of(st.sampled_from(["user", "assistant", "system", "", " ", "tool", "USER", "ipython"]), texts)
chat = st.one_of(
    st.lists(st.builds(generation_pb2.ChatMessage, role=roles, content=st.one_of(texts, big_texts)), max_size=4),
    _many(generation_pb2.ChatMessage(role="user", content="hi"), [1025, 200_000]))


def _maybe(strategy):
    return st.one_of(st.none(), strategy)


# Legal values, the edges of each range included: requests built from these get past
# validation and run, which is where the numerics (sampler, penalties, logprobs) meet them.
LEGAL = {
    "max_tokens": st.one_of(st.integers(1, 8), st.sampled_from([1, 2000, UINT32_MAX])),
    "min_tokens": st.one_of(st.integers(0, 2), st.just(0)),
    "temperature": st.one_of(sane_floats, st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 9.99e-6, 1e-5, 1e300])),
    "top_p": st.one_of(st.floats(1e-6, 1.0), st.sampled_from([5e-324, 1e-300, 0.5, 1.0])),
    "top_k": st.one_of(st.integers(-1, 300), st.sampled_from([1, 258, 259, 260, INT32_MAX])),
    "min_p": st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 5e-324, 1.0])),
    "seed": uint64,
    "repetition_penalty": st.one_of(st.floats(0.5, 2.0), st.sampled_from([5e-324, 1e-300, 1e-30, 1e30, 1e300])),
    "frequency_penalty": st.one_of(st.floats(-2.0, 2.0), st.sampled_from([-2.0, 2.0, -5e-324])),
    "presence_penalty": st.one_of(st.floats(-2.0, 2.0), st.sampled_from([-2.0, 2.0, 5e-324])),
    "logprobs": st.integers(0, 20),
}
# Anything the wire type can carry.
WILD = {
    "max_tokens": uint32, "min_tokens": uint32, "temperature": wild_floats, "top_p": wild_floats, "top_k": int32,
    "min_p": wild_floats, "seed": uint64, "repetition_penalty": wild_floats, "frequency_penalty": wild_floats,
    "presence_penalty": wild_floats, "logprobs": uint32,
}


@st.composite
def sampling_params(draw, legal: bool = True, max_tokens=None):
    """Legal fields with at most one wild one (``legal``), or every field wild."""
    wild_field = draw(st.one_of(st.none(), st.sampled_from(sorted(WILD)))) if legal else None
    fields = {}
    for name in sorted(WILD):
        strategy = LEGAL[name] if legal and name != wild_field else WILD[name]
        if name == "max_tokens" and max_tokens is not None and name != wild_field:
            strategy = max_tokens
        fields[name] = draw(_maybe(strategy))
    if legal and wild_field != "min_tokens" and fields["min_tokens"] and fields["max_tokens"]:
        fields["min_tokens"] = min(fields["min_tokens"], fields["max_tokens"])
    msg = generation_pb2.SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    stops = st.lists(texts.filter(bool), max_size=4) if legal else st.one_of(
        st.lists(texts, max_size=6), _many("a", [1000, 100_000]),
        st.sampled_from([257, 1_000_000]).map(lambda n: ["s" * n]))
    msg.stop.extend(draw(stops))
    stop_ids = st.lists(st.integers(0, 258), max_size=4) if legal else st.one_of(
        st.lists(token_id, max_size=4), _many(7, [129, 3_000_000]))
    msg.stop_token_ids.extend(draw(stop_ids))
    msg.ignore_eos = draw(st.booleans())
    return msg


# Conversations the test template accepts: optional system turn, then user/assistant alternating.
good_chat = st.tuples(st.booleans(), st.lists(texts, min_size=1, max_size=4)).map(lambda t: (
    [generation_pb2.ChatMessage(role="system", content="be brief")] if t[0] else []) + [
    generation_pb2.ChatMessage(role="user" if i % 2 == 0 else "assistant", content=c) for i, c in enumerate(t[1])])


@st.composite
def generate_requests(draw, max_tokens=None):
    """Half legal-at-the-edges requests (one prompt kind, legal sampling but for at most one
    field), half wild ones (any prompt kinds, any values)."""
    legal = draw(st.booleans())
    req = generation_pb2.GenerateRequest(request_id=draw(odd_ids), priority=draw(int32),
                                         stream_interval=draw(st.one_of(st.integers(0, 4), uint32)))
    if legal:
        kind = draw(st.sampled_from(["text", "token_ids", "messages"]))
        if kind == "text":
            req.text = draw(texts.filter(bool))
        elif kind == "token_ids":
            req.token_ids.extend(draw(st.lists(st.integers(0, 258), min_size=1, max_size=40)))
        else:
            req.messages.extend(draw(good_chat))
    else:
        # Each prompt kind independently: none, one or several may be set.
        kinds = draw(st.sets(st.sampled_from(["text", "token_ids", "messages"])))
        if "text" in kinds:
            req.text = draw(st.one_of(texts, big_texts))
        if "token_ids" in kinds:
            req.token_ids.extend(draw(token_lists))
        if "messages" in kinds:
            req.messages.extend(draw(chat))
    if legal or draw(st.booleans()):
        req.sampling.CopyFrom(draw(sampling_params(legal, max_tokens)))
    return req


@st.composite
def long_streams(draw):
    """Legal Generate requests with long outputs of varied shapes (chunk sizes, logprobs, any
    text, stop strings, sampling), for clients that stop reading."""
    req = generation_pb2.GenerateRequest(stream_interval=draw(st.one_of(st.integers(0, 4),
                                                                         st.sampled_from([64, UINT32_MAX]))))
    kind = draw(st.sampled_from(["text", "token_ids", "messages"]))
    if kind == "text":
        req.text = draw(texts.filter(bool))
    elif kind == "token_ids":
        req.token_ids.extend(draw(st.lists(st.integers(0, 258), min_size=1, max_size=40)))
    else:
        req.messages.extend(draw(good_chat))
    req.sampling.CopyFrom(generation_pb2.SamplingParams(
        max_tokens=draw(st.integers(100, 900)), temperature=draw(st.sampled_from([0.0, 0.7, 1.5])),
        logprobs=draw(st.integers(0, 5)), ignore_eos=draw(st.booleans()),
        stop=draw(st.lists(texts.filter(bool), max_size=2))))
    return req


def tokenize_requests():
    return st.builds(generation_pb2.TokenizeRequest, text=st.one_of(texts, big_texts), messages=chat,
                     add_generation_prompt=st.booleans())


def requests(max_tokens=None):
    """(rpc name, request message) over every public RPC, Generate most often. ``max_tokens``:
    a strategy replacing the legal max_tokens values (the wild ones stay wild)."""
    return st.one_of(
        generate_requests(max_tokens).map(lambda r: ("Generate", r)),
        generate_requests(max_tokens).map(lambda r: ("Generate", r)),
        tokenize_requests().map(lambda r: ("Tokenize", r)),
        st.builds(generation_pb2.GetRequestRequest, request_id=odd_ids).map(lambda r: ("GetRequest", r)),
        st.builds(generation_pb2.AbortRequest, request_id=odd_ids).map(lambda r: ("Abort", r)),
        st.just(("GetModelInfo", generation_pb2.GetModelInfoRequest())),
        st.just(("GetServerInfo", generation_pb2.GetServerInfoRequest())),
    )


@st.composite
def oversized_requests(draw, limits: RequestLimits, max_model_len: int):
    """``(rpc, field path, request)``: a request the server would take but for one field just
    or far past its limit (``limits`` as resolved for the served model); the refusal must be
    INVALID_ARGUMENT with a message starting with the field path."""
    def over(limit: int) -> int:
        return draw(st.sampled_from([limit + 1, 2 * limit, 50 * limit]))
    req = generation_pb2.GenerateRequest(request_id=draw(st.sampled_from(["", "over-1"])),
                                         sampling=draw(sampling_params(legal=True, max_tokens=st.integers(1, 4))))
    del req.sampling.stop[:]
    del req.sampling.stop_token_ids[:]
    req.token_ids.extend([1, 2, 3])
    field = draw(st.sampled_from(["request_id", "request_id bytes", "text", "text bytes", "messages",
                                  "messages bytes", "token_ids", "sampling.stop", "sampling.stop[0]",
                                  "sampling.stop_token_ids"]))
    path = field.split(" ")[0]
    if field == "request_id":
        req.request_id = "i" * over(limits.max_request_id_bytes)
    elif field == "request_id bytes":  # within the limit in characters, past it in UTF-8 bytes
        req.request_id = "é" * (limits.max_request_id_bytes // 2 + 1)
    elif field.startswith(("text", "messages", "token_ids")):
        del req.token_ids[:]
        if field == "text":
            req.text = "t" * over(limits.max_prompt_bytes)
        elif field == "text bytes":
            req.text = "😀" * (limits.max_prompt_bytes // 4 + 1)
        elif field == "messages":
            req.messages.extend([generation_pb2.ChatMessage(role="user", content="hi")] * over(limits.max_messages))
        elif field == "messages bytes":
            req.messages.append(generation_pb2.ChatMessage(role="user", content="m" * over(limits.max_prompt_bytes)))
        else:
            req.token_ids.extend([1] * draw(st.sampled_from([max_model_len, 2 * max_model_len])))
    elif field == "sampling.stop":
        req.sampling.stop.extend(["s"] * over(limits.max_stop_sequences))
    elif field == "sampling.stop[0]":
        req.sampling.stop.append("s" * over(limits.max_stop_bytes))
    else:
        req.sampling.stop_token_ids.extend([1] * over(limits.max_stop_token_ids))
    if field.startswith(("text", "messages")) and draw(st.booleans()):  # Tokenize has the same limits
        tokenize = generation_pb2.TokenizeRequest(text=req.text, add_generation_prompt=True)
        tokenize.messages.extend(req.messages)
        return "Tokenize", path, tokenize
    return "Generate", path, req


# ---- calling -------------------------------------------------------------------------------

def call(stub, rpc: str, request, read_budget=READ_BUDGET) -> tuple[str, str]:
    """(status name, details) of one call. A Generate stream read to its end, or cut by the
    client after ``read_budget``, is "OK"; so is one that ended with a final message."""
    try:
        if rpc != "Generate":
            getattr(stub, rpc)(request, timeout=RPC_TIMEOUT_S)
            return "OK", ""
        stream = stub.Generate(request, timeout=RPC_TIMEOUT_S)
        max_messages, max_s = read_budget
        start, n = time.monotonic(), 0
        for response in stream:
            n += 1
            if response.HasField("final"):
                break
            if n >= max_messages or time.monotonic() - start > max_s:
                stream.cancel()
                return "OK", "cut by the client"
        return "OK", ""
    except grpc.RpcError as e:
        return e.code().name, e.details() or ""


def stalled_call(address: str, request, read_first: int, stall_s: float) -> tuple[str, str]:
    """(status name, details) of a Generate whose client reads ``read_first`` messages, stops
    reading for ``stall_s`` (its small HTTP/2 window fills up), then reads on to the end."""
    from tests.harness.hostile import loopback_channel
    from splitserve.v1 import generation_pb2_grpc
    with loopback_channel(address) as channel:
        stream = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=RPC_TIMEOUT_S)
        try:
            messages = iter(stream)
            for _ in range(read_first):
                if next(messages, None) is None:
                    return "OK", ""
            time.sleep(stall_s)
            for _ in messages:
                pass
            return "OK", ""
        except grpc.RpcError as e:
            return e.code().name, e.details() or ""


def describe(rpc: str, request, limit: int = 60) -> str:
    """One line naming the request, long strings and lists abbreviated (enough to rebuild it)."""
    from google.protobuf import json_format

    def short(value):
        if isinstance(value, str) and len(value) > limit:
            return f"{value[:limit // 2]}...<{len(value)} chars>"
        if isinstance(value, list):
            items = [short(v) for v in value[:8]]
            return items + [f"...<{len(value)} items>"] if len(value) > 8 else items
        if isinstance(value, dict):
            return {k: short(v) for k, v in value.items()}
        return value
    body = json_format.MessageToDict(request, preserving_proto_field_name=True)
    return f"{rpc}({type(request).__name__} {json.dumps(short(body), ensure_ascii=True)})"
