"""A small client backend services import instead of writing their own (sync and asyncio).

    from splitserve.client import Client
    with Client("localhost:50051") as client:
        for event in client.generate("Hello", max_tokens=16):
            print(event.text, end="")
        print(event.finish_reason)

Against a secured gateway (docs/security.md): ``Client(address, ca="ca.pem")`` for TLS,
plus ``cert="client.pem", key="client.key"`` for mutual TLS, and ``token=...`` for the bearer
token; ``tls=True`` alone verifies the server against the system's roots.

With ``retry=True``, a ``generate`` refused with UNAVAILABLE or RESOURCE_EXHAUSTED before any
token came back is sent again after the server's pushback (or a backoff), within its deadline
(``splitserve.common.grpc_options.retry_delay``); off by default, so a caller sees every refusal. Every
event carries its request's id (the server's own when none was given), so a stream can be
aborted from its first event on.
"""
from __future__ import annotations

import asyncio
import itertools
import sys
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

import grpc

from splitserve.common.grpc_options import client_options, retry_delay
from splitserve.common.security import DEFAULT_MAX_MESSAGE_MB, Security
from splitserve.v1 import generation_pb2, generation_pb2_grpc

_SAMPLING_FIELDS = {f.name for f in generation_pb2.SamplingParams.DESCRIPTOR.fields}


@dataclass
class Event:
    """One streamed message: new tokens and text, and on the last one the finish reason."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str = ""
    matched_stop: str = ""
    usage: generation_pb2.Usage | None = None
    timeline: generation_pb2.Timeline | None = None
    logprobs: list[generation_pb2.TokenLogprobs] = field(default_factory=list)  # one per token, when asked
    error: str = ""  # on the last event of a request that ended in error
    request_id: str = ""
    index: int = 0  # the sample it belongs to (n > 1: each sample's events, its own last one included)
    reasoning_text: str = ""  # thinking, apart from text (a gateway with --reasoning-parser)
    tool_calls: list[generation_pb2.ToolCall] = field(default_factory=list)  # calls written in full (tools)


def build_request(prompt: str | Sequence[int] | None = None, *, messages: Sequence[dict] | None = None,
                  request_id: str = "", priority: int = 0, stream_interval: int = 0,
                  tools: Sequence[dict] = (), tool_choice: str | None = None, parallel_tool_calls: bool | None = None,
                  **sampling) -> generation_pb2.GenerateRequest:
    """``tools``: OpenAI's tool objects; ``tool_choice``: "none", "auto", "required" or a
    function's name (any other string)."""
    unknown = set(sampling) - _SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
    request = generation_pb2.GenerateRequest(request_id=request_id, priority=priority,
                                             stream_interval=stream_interval,
                                             sampling=generation_pb2.SamplingParams(**sampling))
    if messages is not None:
        request.messages.extend(generation_pb2.ChatMessage(**m) for m in messages)
    elif isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.extend(prompt)
    for tool in tools:
        request.tools.add().update(tool)
    if tool_choice in ("none", "auto", "required"):
        request.tool_choice.mode = tool_choice
    elif tool_choice is not None:
        request.tool_choice.function = tool_choice
    if parallel_tool_calls is not None:
        request.parallel_tool_calls = parallel_tool_calls
    return request


def _event(response: generation_pb2.GenerateResponse) -> Event:
    if response.HasField("final"):
        f = response.final
        return Event(finished=True, finish_reason=f.finish_reason, matched_stop=f.matched_stop,
                     usage=f.usage, timeline=f.timeline, error=f.error, request_id=response.request_id,
                     index=response.index)
    chunk = response.chunk
    return Event(token_ids=list(chunk.token_ids), text=chunk.text, logprobs=list(chunk.logprobs),
                 request_id=response.request_id, index=response.index, reasoning_text=chunk.reasoning_text,
                 tool_calls=list(chunk.tool_calls))


def _tokenize_request(text: str | None, messages: Sequence[dict] | None, add_generation_prompt: bool,
                      add_special_tokens: bool | None) -> generation_pb2.TokenizeRequest:
    """``add_special_tokens`` None: as a generation encodes (yes for text, no for messages)."""
    request = generation_pb2.TokenizeRequest(text=text or "", add_generation_prompt=add_generation_prompt)
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    request.messages.extend(generation_pb2.ChatMessage(**m) for m in messages or ())
    return request


def _left(deadline: float | None) -> float | None:
    """Seconds to ``deadline`` (monotonic), at least 0; None without one."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def client_security(tls: bool = False, ca=None, cert=None, key=None, token: str | None = None,
                    max_message_mb: float = DEFAULT_MAX_MESSAGE_MB) -> Security:
    """The client side of ``Security``: ``ca``/``cert``/``key`` are PEM paths or PEM bytes."""
    return Security.load(cert, key, ca, token or "", tls=tls, max_message_mb=max_message_mb)


class Client:
    """``tls``/``ca``/``cert``/``key``/``token``: see the module docstring; ``credentials`` overrides the TLS
    part; ``retry``: the channel retries calls refused before any token (see the module docstring)."""

    def __init__(self, address: str = "localhost:50051", credentials: grpc.ChannelCredentials | None = None, *,
                 tls: bool = False, ca=None, cert=None, key=None, token: str | None = None,
                 max_message_mb: float = DEFAULT_MAX_MESSAGE_MB, retry: bool = False):
        security = client_security(tls, ca, cert, key, token, max_message_mb)
        self.channel = security.channel(address, credentials, options=client_options())
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.retry = retry

    def generate(self, prompt=None, *, timeout: float | None = None, **kwargs) -> Iterator[Event]:
        request = build_request(prompt, **kwargs)
        deadline = None if timeout is None else time.monotonic() + timeout
        for attempt in itertools.count(1):
            streamed = False
            try:
                for response in self.stub.Generate(request, timeout=_left(deadline)):
                    streamed = True
                    yield _event(response)
                return
            except grpc.RpcError as e:
                delay = retry_delay(e, attempt, streamed, _left(deadline)) if self.retry else None
                if delay is None:
                    raise
            time.sleep(delay)

    def complete(self, prompt=None, **kwargs) -> tuple[str, Event]:
        """The whole text and the final event (of one sample: read ``generate``'s events by
        their ``index`` for n > 1)."""
        if kwargs.get("n", 1) != 1:
            raise ValueError("complete() returns one sample; iterate generate() and group events by index for n > 1")
        text, last = [], None
        for event in self.generate(prompt, **kwargs):
            text.append(event.text)
            last = event
        return "".join(text), last

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(generation_pb2.AbortRequest(request_id=request_id)).found

    def get_request(self, request_id: str) -> generation_pb2.RequestInfo:
        return self.stub.GetRequest(generation_pb2.GetRequestRequest(request_id=request_id))

    def tokenize(self, text: str | None = None, *, messages: Sequence[dict] | None = None,
                 add_generation_prompt: bool = True, add_special_tokens: bool | None = None) -> list[int]:
        request = _tokenize_request(text, messages, add_generation_prompt, add_special_tokens)
        return list(self.stub.Tokenize(request).token_ids)

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.stub.Detokenize(generation_pb2.DetokenizeRequest(
            token_ids=token_ids, skip_special_tokens=skip_special_tokens)).text

    def model_info(self) -> generation_pb2.ModelInfo:
        return self.stub.GetModelInfo(generation_pb2.GetModelInfoRequest())

    def server_info(self) -> generation_pb2.ServerInfo:
        return self.stub.GetServerInfo(generation_pb2.GetServerInfoRequest())

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """The asyncio counterpart of ``Client``, method for method."""

    def __init__(self, address: str = "localhost:50051", credentials: grpc.ChannelCredentials | None = None, *,
                 tls: bool = False, ca=None, cert=None, key=None, token: str | None = None,
                 max_message_mb: float = DEFAULT_MAX_MESSAGE_MB, retry: bool = False):
        security = client_security(tls, ca, cert, key, token, max_message_mb)
        self.channel = security.aio_channel(address, credentials, options=client_options())
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.retry = retry

    async def generate(self, prompt=None, *, timeout: float | None = None, **kwargs) -> AsyncIterator[Event]:
        request = build_request(prompt, **kwargs)
        deadline = None if timeout is None else time.monotonic() + timeout
        for attempt in itertools.count(1):
            streamed = False
            try:
                async for response in self.stub.Generate(request, timeout=_left(deadline)):
                    streamed = True
                    yield _event(response)
                return
            except grpc.RpcError as e:
                delay = retry_delay(e, attempt, streamed, _left(deadline)) if self.retry else None
                if delay is None:
                    raise
            await asyncio.sleep(delay)

    async def abort(self, request_id: str) -> bool:
        return (await self.stub.Abort(generation_pb2.AbortRequest(request_id=request_id))).found

    async def get_request(self, request_id: str) -> generation_pb2.RequestInfo:
        return await self.stub.GetRequest(generation_pb2.GetRequestRequest(request_id=request_id))

    async def tokenize(self, text: str | None = None, *, messages: Sequence[dict] | None = None,
                       add_generation_prompt: bool = True, add_special_tokens: bool | None = None) -> list[int]:
        reply = await self.stub.Tokenize(_tokenize_request(text, messages, add_generation_prompt, add_special_tokens))
        return list(reply.token_ids)

    async def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return (await self.stub.Detokenize(generation_pb2.DetokenizeRequest(
            token_ids=token_ids, skip_special_tokens=skip_special_tokens))).text

    async def model_info(self) -> generation_pb2.ModelInfo:
        return await self.stub.GetModelInfo(generation_pb2.GetModelInfoRequest())

    async def server_info(self) -> generation_pb2.ServerInfo:
        return await self.stub.GetServerInfo(generation_pb2.GetServerInfoRequest())

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def cmd_generate(args) -> int:
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.top_p is not None:
        sampling["top_p"] = args.top_p
    if args.seed is not None:
        sampling["seed"] = args.seed
    kwargs = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {}
    prompt = None if args.chat else args.prompt
    try:
        client = Client(args.address, tls=args.tls, ca=args.tls_ca or None, cert=args.tls_cert or None,
                        key=args.tls_key or None, token=args.auth_token or None)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        with client:
            for event in client.generate(prompt, timeout=args.timeout, **kwargs, **sampling):
                if event.finished:
                    print(f"\n[{event.finish_reason}; {event.usage.prompt_tokens} prompt + "
                          f"{event.usage.completion_tokens} completion tokens; first token after "
                          f"{event.timeline.first_token_ms:.0f} ms]", file=sys.stderr)
                else:
                    print(event.text, end="", flush=True)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    return 0
