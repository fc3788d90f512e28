"""``ChatOutput``: one sample's text, as it streams in, split into content, reasoning and tool calls.

Text passes through at once except what could be the start of a marker (``<think>``,
``</think>``, ``<tool_call>``...): that is held until the next text decides. Once a format's calls
have started, each call is handed out whole once written in full (``tool_calls``: what a whole
answer and gRPC carry), and streamed as it is written (``tool_call_parts``: what the HTTP API
streams, as OpenAI does): its id and name as soon as the model has written the name and begun the
arguments, then its arguments as they come: the model's own JSON text, or for ``qwen3_xml`` and
``pythonic`` the JSON the parser writes of each parameter (a string parameter's text as it comes,
other types once whole). What does not parse as a call comes back as content at the end, never as
an error; a call whose name and arguments had begun to stream and then did not parse leaves those
parts with the client (as in vLLM).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.gateway.chat_output.reasoning import ReasoningStream, held_back
from splitserve.gateway.chat_output.tool_parsers import ToolParser
from splitserve.gateway.chat_output.tools import ToolCall, ToolCallPart, new_call_id

@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls written in full
    tool_call_parts: list[ToolCallPart] = field(default_factory=list)  # the same calls as they stream

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls or self.tool_call_parts)


@dataclass
class _Streaming:
    """A call whose arguments are streaming: its JSON object is scanned as it comes (strings and
    nesting followed) so that what is sent is inside the object, up to its closing brace."""

    index: int  # the call's place in the answer
    id: str
    start: int  # where its arguments object begins in the tool text
    scanned: int  # the tool text up to here is scanned (and sent)
    # Formats whose arguments the parser writes as JSON (``ToolParser.partial_arguments``): the
    # JSON sent so far; None for the others, whose arguments are the model's own text.
    built: str | None = None
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    closed: bool = False

    def scan(self, text: str) -> str:
        """The arguments text past what was sent, up to the object's end if it has come."""
        i, n = self.scanned, len(text)
        while i < n and not self.closed:
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                self.closed = self.depth == 0
            i += 1
        fragment, self.scanned = text[self.scanned:i], i
        return fragment


class ToolStream:
    """Content with the calls a parser finds in it taken out."""

    def __init__(self, parser: ToolParser, parallel: bool = True):
        self.parser = parser
        self.parallel = parallel  # False: the first call only (parallel_tool_calls false)
        self.state = "text"  # text: no call yet | calls: the format's calls started | plain: none can come
        self.pending = ""  # text held back (a marker may be starting)
        self.tool_text = ""  # from the first marker on
        self.found = 0  # calls found so far (handed out, or dropped when not parallel)
        self.parsed_end = 0  # where the tool text's finished calls end
        self.streaming: _Streaming | None = None  # the call being written, once its name is

    def feed(self, text: str) -> tuple[str, list[ToolCall], list[ToolCallPart]]:
        if self.state == "plain":
            return text, [], []
        if self.state == "text":
            content = self._before_calls(text)
            if self.state != "calls":
                return content, [], []
            calls, parts = self._finished(self.parser.parse(self.tool_text, final=False))
            return content, calls, parts + self._stream()
        self.tool_text += text
        calls, parts = [], []
        if any(c in text for c in self.parser.closers):  # only then can a call have been finished
            calls, parts = self._finished(self.parser.parse(self.tool_text, final=False))
        return "", calls, parts + self._stream()

    def _before_calls(self, text: str) -> str:
        """Content that comes before the calls (if any); switches state when they start."""
        self.pending += text
        starts = self.parser.starts
        if self.parser.at_start_only:
            head = self.pending.lstrip()
            if not head or any(m.startswith(head) and m != head for m in starts):
                return ""  # whitespace so far, or a marker's beginning
            if any(head.startswith(m) for m in starts):
                self.state, self.tool_text, self.pending = "calls", head, ""
                return ""
            self.state = "plain"
            content, self.pending = self.pending, ""
            return content
        found = [i for i in (self.pending.find(m) for m in starts) if i >= 0]
        if found:
            first = min(found)
            content, self.tool_text, self.pending = self.pending[:first], self.pending[first:], ""
            self.state = "calls"
            return content
        keep = held_back(self.pending, starts)
        content, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return content

    def _finished(self, parsed) -> tuple[list[ToolCall], list[ToolCallPart]]:
        """The calls ``parsed`` holds past those handed out: whole, and the parts of them not
        streamed yet (a call that streamed gets the rest of its arguments' text)."""
        calls, parts = [], []
        for name, arguments in parsed.calls[self.found:]:
            index = self.found
            self.found += 1
            if not self.parallel and index >= 1:
                continue
            streaming, self.streaming = self.streaming, None
            if streaming is not None and streaming.index == index:
                if streaming.built is None:
                    rest = streaming.scan(self.tool_text)
                else:  # the whole call's JSON past what was sent (nothing if it no longer extends it)
                    rest = arguments[len(streaming.built):] if arguments.startswith(streaming.built) else ""
                if rest:
                    parts.append(ToolCallPart(index, rest))
                calls.append(ToolCall(streaming.id, name, arguments))
                continue
            call = ToolCall(new_call_id(self.parser.mistral_ids), name, arguments)
            calls.append(call)
            parts += [ToolCallPart(index, "", call.id, name), ToolCallPart(index, arguments)]
        if parsed.calls:
            self.parsed_end = max(self.parsed_end, parsed.end)
        return calls, parts

    def _stream(self) -> list[ToolCallPart]:
        """The call being written: its first part once its name is, then its arguments so far."""
        parts = []
        if self.streaming is None:
            if not self.parallel and self.found >= 1:
                return []
            begun = self.parser.partial(self.tool_text, self.parsed_end)
            built = self.parser.partial_arguments(self.tool_text, self.parsed_end) if begun is None else None
            if begun is None and built is None:
                return []
            name, start = begun if begun is not None else (built[0], -1)
            self.streaming = _Streaming(self.found, new_call_id(self.parser.mistral_ids), start, start,
                                        built="" if built is not None else None)
            parts.append(ToolCallPart(self.found, "", self.streaming.id, name))
        if self.streaming.built is None:
            fragment = self.streaming.scan(self.tool_text)
        else:
            built = self.parser.partial_arguments(self.tool_text, self.parsed_end)
            fragment = ""
            if built is not None and built[1].startswith(self.streaming.built):
                fragment, self.streaming.built = built[1][len(self.streaming.built):], built[1]
        if fragment:
            parts.append(ToolCallPart(self.streaming.index, fragment))
        return parts

    def finish(self) -> tuple[str, list[ToolCall], list[ToolCallPart]]:
        if self.state != "calls":
            content, self.pending = self.pending, ""
            return content, [], []
        parsed = self.parser.parse(self.tool_text, final=True)
        if not parsed.calls:  # malformed: what the model wrote is its answer
            return self.tool_text, [], []
        calls, parts = self._finished(parsed)
        rest = self.tool_text[parsed.end:]
        return (rest if rest.strip() else ""), calls, parts


class NamedCall:
    """``tool_choice`` naming a function: the whole output is its arguments (constrained to them),
    streamed as they come."""

    def __init__(self, name: str):
        self.name = name
        self.id = new_call_id()
        self.arguments = ""

    def feed(self, text: str) -> tuple[str, list[ToolCall], list[ToolCallPart]]:
        parts = [] if self.arguments or not text else [ToolCallPart(0, "", self.id, self.name)]
        self.arguments += text
        return "", [], parts + ([ToolCallPart(0, text)] if text else [])

    def finish(self) -> tuple[str, list[ToolCall], list[ToolCallPart]]:
        parts = [] if self.arguments else [ToolCallPart(0, "", self.id, self.name)]
        return "", [ToolCall(self.id, self.name, self.arguments)], parts


class ChatOutput:
    """One sample's answer: reasoning first (if the server parses it), then content with calls."""

    def __init__(self, reasoning: ReasoningStream | None = None, tools: ToolStream | NamedCall | None = None):
        self.reasoning = reasoning
        self.tools = tools
        self.calls: list[ToolCall] = []  # every call handed out so far

    def feed(self, text: str) -> Delta:
        reasoning, content = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        return self._content(reasoning, content)

    def finish(self) -> Delta:
        reasoning, content = self.reasoning.finish() if self.reasoning is not None else ("", "")
        delta = self._content(reasoning, content)
        if self.tools is not None:
            content, calls, parts = self.tools.finish()
            delta.content += content
            delta.tool_calls += calls
            delta.tool_call_parts += parts
            self.calls += calls
        return delta

    def end(self, rest: str) -> Delta:
        """The answer's last text (held back for a stop string) and whatever the parsers still hold."""
        delta, last = self.feed(rest), self.finish()
        return Delta(delta.content + last.content, delta.reasoning + last.reasoning,
                     delta.tool_calls + last.tool_calls, delta.tool_call_parts + last.tool_call_parts)

    def finish_reason(self, reason: str) -> str:
        """OpenAI's: "tool_calls" for an answer that called tools and ended by itself; a named
        call keeps its own ("stop"), as OpenAI's does."""
        called = self.calls and not isinstance(self.tools, NamedCall)
        return "tool_calls" if called and reason in ("eos", "stop") else reason

    def _content(self, reasoning: str, content: str) -> Delta:
        calls, parts = [], []
        if self.tools is not None and content:
            content, calls, parts = self.tools.feed(content)
            self.calls += calls
        return Delta(content, reasoning, calls, parts)
