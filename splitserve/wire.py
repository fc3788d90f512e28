"""Proto <-> domain conversion at the edge: the only module that knows both sides.

Servicers call these helpers on the way in (``check_sizes`` first, against the gateway's
``splitserve.common.limits.RequestLimits``; then ``*_from_proto``, which validate and raise
``InvalidArgument`` naming the offending field) and on the way out (``*_to_proto``); engine and
kvtransfer code never sees a ``*_pb2`` type.

Sampling is validated and resolved once, at the gateway (``resolve_sampling``): an unset
``max_tokens`` is ``DEFAULT_MAX_TOKENS`` (256, the engine's own default of 16 is too short for a
chat reply) or what the model's length leaves after the prompt, if less; an unset ``temperature``
is ``DEFAULT_TEMPERATURE`` (1.0, same as the engine). A model's ``generation_config.json`` may
set its own defaults for some fields (temperature, top_p, top_k, min_p, repetition_penalty,
max_tokens: ``splitserve.engine.model_files.sampling_defaults``); the gateway passes them in and
they come before these, as in vLLM. Every other unset field keeps the engine
default (see ``splitserve.engine.sampling_params.SamplingParams``). The resolved parameters travel to the
workers as ``worker_pb2.ResolvedSampling`` (every field set); a worker converts them back with
``sampling_from_worker`` and applies no defaults of its own.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import TYPE_CHECKING, Mapping, Sequence

from google.protobuf import json_format

from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.structured_output import StructuredOutput
from splitserve.common.errors import InvalidArgument
from splitserve.v1 import generation_pb2, worker_pb2

if TYPE_CHECKING:  # splitserve.kvtransfer.base imports torch; the gateway converts descriptors without it
    from splitserve.common.limits import RequestLimits

__all__ = [
    "DEFAULT_MAX_TOKENS", "DEFAULT_TEMPERATURE", "PROMPT_FIELDS", "sampling_from_proto", "resolve_sampling",
    "check_sampling_defaults", "struct_to_python",
    "sampling_to_worker", "sampling_from_worker", "arrival_to_monotonic", "check_sizes", "check_grammar_size",
    "prompt_from_request",
    "structured_output_from_proto", "structured_output_to_proto", "descriptor_to_proto", "descriptor_from_proto", "logprobs_to_proto", "logprobs_from_proto",
]

DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 1.0

# Proto3 ``optional`` scalars of SamplingParams: copied only when the client set them.
_OPTIONAL_SAMPLING_FIELDS = (
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
    "repetition_penalty", "frequency_penalty", "presence_penalty", "logprobs",
)
_ENGINE_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))

# The ways a prompt can be given, in the order error messages list them.
PROMPT_FIELDS = ("text", "token_ids", "messages")


# ---- sampling --------------------------------------------------------------------------

def sampling_from_proto(msg: generation_pb2.SamplingParams | None,
                        defaults: Mapping[str, float | int] | None = None) -> SamplingParams:
    """Engine sampling parameters from the proto; unset fields take ``defaults`` (the model's),
    then the defaults above.

    Raises ``InvalidArgument`` whose message starts with the field path, e.g.
    ``"sampling.temperature must be >= 0, got -1.0"``.
    """
    kwargs: dict = {"max_tokens": DEFAULT_MAX_TOKENS, "temperature": DEFAULT_TEMPERATURE, **(defaults or {})}
    if msg is not None:
        for name in _OPTIONAL_SAMPLING_FIELDS:
            if msg.HasField(name):
                kwargs[name] = getattr(msg, name)
        kwargs["stop"] = list(msg.stop)
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
        kwargs["ignore_eos"] = msg.ignore_eos
    try:
        if msg is not None and msg.HasField("structured_output"):
            # Checked against the grammar library by the gateway (splitserve.gateway.grammar_check).
            kwargs["structured_output"] = structured_output_from_proto(msg.structured_output)
        return SamplingParams(**kwargs)
    except ValueError as exc:
        # The engine's messages start with the field name ("top_k must be ..."); prefix the
        # message path so a JSON caller sees exactly what to fix.
        text = str(exc)
        first = text.split(" ", 1)[0].split(".", 1)[0]
        path = f"sampling.{text}" if first in _ENGINE_SAMPLING_FIELDS else f"invalid sampling: {text}"
        raise InvalidArgument(path) from exc


def resolve_sampling(msg: generation_pb2.SamplingParams | None, num_prompt_tokens: int,
                     max_model_len: int, defaults: Mapping[str, float | int] | None = None) -> SamplingParams:
    """The request's sampling, validated and resolved against the model's length (the gateway's
    one check): the prompt plus ``max_tokens`` must fit ``max_model_len``. An unset ``max_tokens``
    takes the default (the model's, else ``DEFAULT_MAX_TOKENS``) or the room the prompt leaves,
    whichever is less. ``defaults``: the model's sampling defaults (checked once, at start, by
    ``check_sampling_defaults``)."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise InvalidArgument(f"prompt has {num_prompt_tokens} tokens; max_model_len is {max_model_len}, "
                              "which leaves no room for a generated token")
    params = sampling_from_proto(msg, defaults)
    if msg is not None and msg.HasField("max_tokens"):
        if params.max_tokens > room:
            raise InvalidArgument(f"sampling.max_tokens: prompt ({num_prompt_tokens} tokens) + max_tokens "
                                  f"({params.max_tokens}) exceeds max_model_len ({max_model_len}); "
                                  f"ask for at most {room} tokens")
        return params
    try:
        return dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
    except ValueError as exc:  # min_tokens above the room left
        raise InvalidArgument(f"sampling.min_tokens: {params.min_tokens} tokens do not fit after a "
                              f"{num_prompt_tokens}-token prompt (max_model_len {max_model_len})") from exc


def check_sampling_defaults(defaults: Mapping[str, float | int]) -> None:
    """ValueError naming the field when a model's sampling defaults are not valid values (a
    gateway refuses to start on them rather than fail every request that leaves them unset)."""
    SamplingParams(**defaults)


def structured_output_from_proto(msg: generation_pb2.StructuredOutput, resumed_tokens: int = 0,
                                 after_token_ids=(), after_opener: int | None = None) -> StructuredOutput:
    """The proto's oneof -> the engine's spec (ValueError naming the field if it is empty or bad)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_output must set one of json_schema, json_object, regex, choice")
    if kind == "json_object" and not msg.json_object:
        raise ValueError("structured_output.json_object must be true when set")
    value = tuple(msg.choice.values) if kind == "choice" else getattr(msg, kind)
    return StructuredOutput(**{kind: value}, resumed_tokens=resumed_tokens, after_token_ids=tuple(after_token_ids),
                            after_opener=after_opener)


def structured_output_to_proto(spec: StructuredOutput) -> generation_pb2.StructuredOutput:
    if spec.kind == "choice":
        return generation_pb2.StructuredOutput(choice=generation_pb2.StringList(values=spec.choice))
    return generation_pb2.StructuredOutput(**{spec.kind: getattr(spec, spec.kind)})


def sampling_to_worker(params: SamplingParams) -> worker_pb2.ResolvedSampling:
    """Resolved engine parameters -> the internal message (every field set)."""
    msg = worker_pb2.ResolvedSampling(
        max_tokens=params.max_tokens, min_tokens=params.min_tokens, temperature=params.temperature,
        top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        repetition_penalty=params.repetition_penalty, frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty, ignore_eos=params.ignore_eos,
        stop_token_ids=params.stop_token_ids)
    if params.seed is not None:
        msg.seed = params.seed
    if params.lora is not None:
        msg.lora = params.lora
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.structured_output is not None:
        msg.structured_output.CopyFrom(structured_output_to_proto(params.structured_output))
        msg.structured_output_resumed_tokens = params.structured_output.resumed_tokens
        msg.structured_output_after_token_ids.extend(params.structured_output.after_token_ids)
        if params.structured_output.after_opener is not None:
            msg.structured_output_after_opener = params.structured_output.after_opener
    return msg


def sampling_from_worker(msg: worker_pb2.ResolvedSampling) -> SamplingParams:
    """The internal message -> engine parameters, taken as given (the engine still checks them:
    a gateway of another version must not crash a worker)."""
    try:
        structured = None
        if msg.HasField("structured_output"):
            structured = structured_output_from_proto(msg.structured_output, msg.structured_output_resumed_tokens,
                                                      msg.structured_output_after_token_ids,
                                                      msg.structured_output_after_opener
                                                      if msg.HasField("structured_output_after_opener") else None)
        return SamplingParams(
            structured_output=structured, max_tokens=msg.max_tokens, min_tokens=msg.min_tokens, temperature=msg.temperature,
            top_p=msg.top_p, top_k=msg.top_k, min_p=msg.min_p,
            seed=msg.seed if msg.HasField("seed") else None,
            repetition_penalty=msg.repetition_penalty, frequency_penalty=msg.frequency_penalty,
            presence_penalty=msg.presence_penalty, ignore_eos=msg.ignore_eos,
            stop_token_ids=list(msg.stop_token_ids), logprobs=msg.logprobs if msg.HasField("logprobs") else None,
            lora=msg.lora or None)
    except ValueError as exc:
        raise InvalidArgument(f"sampling: {exc}") from exc


def arrival_to_monotonic(arrival_unix_s: float) -> float | None:
    """A gateway's admission time (Unix seconds) on this process's ``time.monotonic`` clock, the
    engine's; None when unset (0) or not a finite time, so the engine stamps its own."""
    if not arrival_unix_s or not math.isfinite(arrival_unix_s):
        return None
    return time.monotonic() - (time.time() - arrival_unix_s)


# ---- sizes -----------------------------------------------------------------------------

def check_sizes(req, limits: "RequestLimits", max_model_len: int) -> None:
    """Refuse a GenerateRequest or TokenizeRequest that carries more than ``limits`` allow
    (``InvalidArgument`` naming the field and the flag), before any work is spent on it.

    Runs first, so its own cost must stay small whatever the message holds: repeated fields are
    judged by their length, strings by their character count before any byte is counted, a
    chat's bytes are summed only until the sum passes the limit.
    """
    fields = req.DESCRIPTOR.fields_by_name
    if "request_id" in fields:
        _check_bytes("request_id", req.request_id, limits.max_request_id_bytes, "--max-request-id-bytes")
    if "token_ids" in fields and len(req.token_ids) >= max_model_len:
        raise InvalidArgument(f"token_ids has {len(req.token_ids)} tokens; max_model_len is {max_model_len}, "
                              "which leaves no room for a generated token")
    # The text is measured before the tokenizer sees it: tokenizing costs far more memory than
    # the text itself (a 12 MB text took gigabytes), so its token count cannot be the check.
    _check_bytes("text", req.text, limits.max_prompt_bytes, "--max-prompt-bytes")
    if len(req.messages) > limits.max_messages:
        raise InvalidArgument(f"messages has {len(req.messages)} entries; this server takes at most "
                              f"{limits.max_messages} (--max-messages)")
    left = limits.max_prompt_bytes
    for i, m in enumerate(req.messages):
        # ByteSize: a parsed message's size, computed without a copy.
        left -= (_utf8_len(m.role, left) + _utf8_len(m.content, left) + _utf8_len(m.tool_call_id, left)
                 + _utf8_len(m.name, left) + sum(call.ByteSize() for call in m.tool_calls))
        if left < 0:
            raise InvalidArgument(f"messages: their roles and contents up to messages[{i}] are more than the "
                                  f"{limits.max_prompt_bytes} bytes this server takes (--max-prompt-bytes)")
    for name in ("tools", "documents"):
        entries = getattr(req, name)
        if len(entries) > limits.max_messages:
            raise InvalidArgument(f"{name} has {len(entries)} entries; this server takes at most "
                                  f"{limits.max_messages} (--max-messages)")
        left -= sum(entry.ByteSize() for entry in entries)
        if left < 0:
            raise InvalidArgument(f"{name}: with the messages, more than the {limits.max_prompt_bytes} bytes this "
                                  "server takes (--max-prompt-bytes)")
    if req.chat_template_kwargs.ByteSize() > left:
        raise InvalidArgument(f"chat_template_kwargs: with the messages, more than the {limits.max_prompt_bytes} "
                              "bytes this server takes (--max-prompt-bytes)")
    if "sampling" in fields and req.HasField("sampling"):
        sampling = req.sampling
        if len(sampling.stop) > limits.max_stop_sequences:
            raise InvalidArgument(f"sampling.stop has {len(sampling.stop)} strings; this server takes at most "
                                  f"{limits.max_stop_sequences} (--max-stop-sequences)")
        for i, stop in enumerate(sampling.stop):
            _check_bytes(f"sampling.stop[{i}]", stop, limits.max_stop_bytes, "--max-stop-bytes")
        if len(sampling.stop_token_ids) > limits.max_stop_token_ids:
            raise InvalidArgument(f"sampling.stop_token_ids has {len(sampling.stop_token_ids)} ids; this server "
                                  f"takes at most {limits.max_stop_token_ids} (--max-stop-token-ids)")
        if sampling.HasField("structured_output"):
            check_grammar_size(sampling.structured_output, limits)


def check_grammar_size(spec, limits: "RequestLimits", path: str = "") -> None:
    """A structured-output spec's size, and a JSON schema's depth, before anything compiles it;
    ``path``: the field a refusal names (default: the spec's own)."""
    kind = spec.WhichOneof("kind")
    path = path or f"sampling.structured_output.{kind}"
    if kind in ("json_schema", "regex"):
        _check_bytes(path, getattr(spec, kind), limits.max_grammar_bytes, "--max-grammar-bytes")
    elif kind == "choice":
        left = limits.max_grammar_bytes
        for value in spec.choice.values:
            left -= _utf8_len(value, left)
            if left < 0:
                raise InvalidArgument(f"{path}: its strings together are more than the {limits.max_grammar_bytes} "
                                      "bytes this server takes (--max-grammar-bytes)")
    if kind == "json_schema":
        depth = json_depth(spec.json_schema)
        if depth > limits.max_schema_depth:
            raise InvalidArgument(f"{path} nests {depth} levels of objects and arrays; this server takes at most "
                                  f"{limits.max_schema_depth} (--max-schema-depth)")


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """How deep objects and arrays nest in JSON ``text`` (strings skipped), without parsing it:
    a parser recurses once per level."""
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub("", text)):
        depth += 1 if match.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _utf8_len(text: str, limit: int) -> int:
    """UTF-8 length of ``text``, or just more than ``limit`` when its characters alone say it is
    longer (a character is at least one byte): a huge string is never encoded to be measured."""
    return limit + 1 if len(text) > limit else len(text.encode("utf-8"))


def _check_bytes(path: str, text: str, limit: int, flag: str) -> None:
    n = _utf8_len(text, limit)
    if n > limit:
        size = f"{len(text)} characters" if len(text) > limit else f"{n} bytes"
        raise InvalidArgument(f"{path} is {size}; this server takes at most {limit} bytes ({flag})")


# ---- prompt ----------------------------------------------------------------------------

def prompt_from_request(req, vocab_size: int | None = None) -> tuple[str, object]:
    """The one prompt form set in a GenerateRequest (or TokenizeRequest).

    Returns ``("text", str)``, ``("token_ids", list[int])`` or ``("messages", list[dict])``
    with dicts ``{"role": ..., "content": ...}``. Raises ``InvalidArgument`` when none or
    several of the forms are set (an empty string or list counts as unset: proto3 cannot tell
    them apart), for a message without a role, and, when ``vocab_size`` is given, for a token
    id outside ``[0, vocab_size)`` -- in the prompt, or among a GenerateRequest's
    ``sampling.stop_token_ids`` (checked here, at the edge: a worker would refuse it only after
    pages were reserved for the request).
    """
    if vocab_size is not None and "sampling" in req.DESCRIPTOR.fields_by_name:
        for i, tok in enumerate(req.sampling.stop_token_ids):
            if tok >= vocab_size:
                raise InvalidArgument(f"sampling.stop_token_ids[{i}] is {tok}, must be < vocab_size ({vocab_size})")
    present = [name for name in PROMPT_FIELDS if name in req.DESCRIPTOR.fields_by_name]
    chosen = [name for name in present if len(getattr(req, name)) > 0]
    if len(chosen) != 1:
        detail = f" (got {', '.join(chosen)})" if chosen else ""
        raise InvalidArgument(f"exactly one of {', '.join(present)} must be set{detail}")
    kind = chosen[0]
    if kind == "text":
        return "text", req.text
    if kind == "token_ids":
        ids = list(req.token_ids)
        if vocab_size is not None:
            for i, tok in enumerate(ids):
                if tok >= vocab_size:
                    raise InvalidArgument(f"token_ids[{i}] is {tok}, must be < vocab_size ({vocab_size})")
        return "token_ids", ids
    messages = []
    for i, m in enumerate(req.messages):
        if not m.role.strip():
            raise InvalidArgument(f"messages[{i}].role must not be empty (e.g. \"user\")")
        message = {"role": m.role, "content": m.content}
        # A tool turn's id and name, an assistant turn's calls: only where set, as OpenAI's bodies have them.
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [struct_to_python(call) for call in m.tool_calls]
        messages.append(message)
    return "messages", messages


def struct_to_python(struct) -> dict:
    """A ``google.protobuf.Struct`` as the JSON object it was sent as: whole numbers come back
    as ints (a Struct holds every number as a double; a chat template may ``range`` over one), and
    every object's keys in sorted order. A Struct is a map: it keeps no order, and protobuf's map
    iterates in an order of its own that changes from process to process, so the same tools sent
    over gRPC rendered a different prompt in each gateway (and gave different greedy tokens)."""
    return _canonical(json_format.MessageToDict(struct))


def _canonical(value):
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _canonical(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


# ---- logprobs --------------------------------------------------------------------------

def logprobs_to_proto(entry: Sequence[tuple[int, float]] | None) -> generation_pb2.TokenLogprobs | None:
    """One position of the engine's logprobs, ``[(sampled_id, lp), (top1_id, lp), ...]``.

    ``None`` (logprobs not requested) gives ``None``; callers leave the proto field unset.
    """
    if entry is None:
        return None
    if not entry:
        raise ValueError("a logprobs entry starts with the sampled token's (id, logprob); got an empty list")
    (token_id, logprob), *top = entry
    return generation_pb2.TokenLogprobs(
        token_id=token_id, logprob=logprob,
        top=[generation_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top],
    )


def logprobs_from_proto(msg: generation_pb2.TokenLogprobs | None) -> list[tuple[int, float]] | None:
    """Inverse of ``logprobs_to_proto`` (e.g. the first token's logprobs handed to a decode worker)."""
    if msg is None:
        return None
    return [(msg.token_id, msg.logprob)] + [(t.token_id, t.logprob) for t in msg.top]


def worker_info_to_proto(worker_id: str, role: str, address: str, transports, stats: dict,
                         metrics_address: str = "") -> generation_pb2.WorkerInfo:
    """A worker's public description from its engine's ``stats()``."""
    return generation_pb2.WorkerInfo(
        worker_id=worker_id, role=role, address=address, transports=list(transports),
        kv_blocks_total=int(stats.get("kv_blocks_total", 0)), kv_blocks_free=int(stats.get("kv_blocks_free", 0)),
        kv_blocks_cached=int(stats.get("kv_blocks_cached", 0)), num_running=int(stats.get("num_running", 0)),
        num_waiting=int(stats.get("num_waiting", 0)), metrics_address=metrics_address,
        kv_cache_dtype=str(stats.get("kv_cache_dtype", "")), kv_page_bytes=int(stats.get("kv_page_bytes", 0)),
        loras=[str(name) for name in stats.get("loras", ())])
