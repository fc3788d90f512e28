"""A request's output on its way to the client: what its workers produced and its Generate
handler has not taken yet.

The handler takes output whenever it is not busy sending; it is busy for as long as the client
does not take the previous message (gRPC's HTTP/2 flow control: a client that does not read
fills its window, and the send waits). Tokens that arrive meanwhile are **merged** into one
pending batch rather than queued one event each, so a slow client gets fewer, larger chunks (as
vLLM's per-request output collector does) and what waits costs its ids and text, not an object
per token. ``get`` hands over everything pending at once, then the one ``Finished``.

The outbox counts what waits in it (tokens, and bytes as estimated by ``Tokens.nbytes``) and
reports every change to its ``observer`` (the gateway's ``splitserve.gateway.backpressure.Backpressure``,
which bounds both per stream and per gateway).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

import grpc

# What a token costs while it waits, besides its text and logprobs: a list slot and an int
# object (CPython: 8 + 28 bytes; ids under 257 are shared, counted all the same).
TOKEN_BYTES = 36


@dataclass
class Tokens:
    token_ids: list[int]
    logprobs: list = field(default_factory=list)  # TokenLogprobs protos, one per token when asked
    text: str = ""  # their text, as far as it is safe to show (see splitserve.gateway.detokenizer.TextStream)
    # Set where the gateway parses the answer (splitserve.gateway.chat_output), on the way to the
    # client: text is then the content alone.
    reasoning: str = ""  # thinking, apart from the answer
    tool_calls: list = field(default_factory=list)  # ToolCalls written in full by these tokens
    tool_call_parts: list = field(default_factory=list)  # the calls as they stream (ToolCallParts)

    def nbytes(self) -> int:
        """Roughly the memory these tokens hold while they wait (ids, UTF-8 text, logprobs)."""
        return (TOKEN_BYTES * len(self.token_ids) + len(self.text.encode("utf-8", "surrogatepass"))
                + sum(lp.ByteSize() for lp in self.logprobs))

    def parsed(self, delta) -> "Tokens":
        """These tokens with their text split by the sample's parser (``splitserve.gateway.chat_output``)."""
        return Tokens(self.token_ids, self.logprobs, delta.content, delta.reasoning, delta.tool_calls,
                      delta.tool_call_parts)


@dataclass
class Finished:
    finish_reason: str  # length | eos | stop | aborted | deadline | error
    status: grpc.StatusCode | None = None  # set when the request failed
    message: str = ""

    @property
    def terminal_state(self) -> str:
        """The request's terminal state in Redis."""
        return {"length": "finished", "eos": "finished", "stop": "finished", "aborted": "aborted",
                "deadline": "deadline"}.get(self.finish_reason, "failed")


class Observer(Protocol):
    def changed(self, outbox: "Outbox", tokens: int, nbytes: int) -> None:
        """``tokens`` / ``nbytes`` were added to (positive) or taken from (negative) ``outbox``."""


class Outbox:
    def __init__(self) -> None:
        self._pending: Tokens | None = None
        self._end: Finished | None = None
        self._end_taken = False
        self._ready = asyncio.Event()
        self.tokens = 0  # waiting in the outbox now
        self.nbytes = 0
        self.observer: Observer | None = None

    def put_nowait(self, event: Tokens | Finished) -> None:
        if isinstance(event, Finished):
            self._end = event
        elif self._pending is None:
            self._pending = event
            self._count(len(event.token_ids), event.nbytes())
        else:  # the handler is behind: one batch, in order
            pending = self._pending
            pending.token_ids += event.token_ids
            pending.logprobs += event.logprobs
            pending.text += event.text
            self._count(len(event.token_ids), event.nbytes())
        self._ready.set()

    def share_wakeup(self, ready: asyncio.Event) -> None:
        """Set ``ready`` (instead of this outbox's own event) whenever something arrives: one
        reader waits on several outboxes (the samples of an n > 1 request) with one event."""
        self._ready = ready
        if not self.empty():
            ready.set()

    def get_nowait(self) -> Tokens | Finished:
        """Everything pending as one ``Tokens``; once none is left, the ``Finished`` (once)."""
        if self._pending is not None:
            event, self._pending = self._pending, None
            self._count(-self.tokens, -self.nbytes)
            return event
        if self._end is not None and not self._end_taken:
            self._end_taken = True
            return self._end
        raise asyncio.QueueEmpty

    async def get(self) -> Tokens | Finished:
        while True:
            try:
                return self.get_nowait()
            except asyncio.QueueEmpty:
                self._ready.clear()
                await self._ready.wait()

    def empty(self) -> bool:
        return self._pending is None and (self._end is None or self._end_taken)

    def discard(self) -> None:
        """Drop the pending tokens (the request was cut: nobody will read them)."""
        if self._pending is not None:
            self._pending = None
            self._count(-self.tokens, -self.nbytes)

    def _count(self, tokens: int, nbytes: int) -> None:
        self.tokens += tokens
        self.nbytes += nbytes
        if self.observer is not None:
            self.observer.changed(self, tokens, nbytes)
