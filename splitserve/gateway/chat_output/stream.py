"""``ChatOutput``: one sample's text, as it streams in, split into content, reasoning and tool calls.

Text passes through at once except what could be the start of a marker (``<think>``,
``</think>``, ``<tool_call>``...): that is held until the next text decides. Once a format's calls
have started, text is held until each call is written in full; a call is handed out whole
(name and arguments together; the HTTP API streams it as OpenAI does, name first). What does not
parse as a call comes back as content at the end, never as an error.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.gateway.chat_output.reasoning import ReasoningStream, held_back
from splitserve.gateway.chat_output.tool_parsers import ToolParser
from splitserve.gateway.chat_output.tools import ToolCall, new_call_id

# A call can only have been completed by text holding one of these: the parse is tried again then.
_CLOSERS = frozenset("}])>")


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class ToolStream:
    """Content with the calls a parser finds in it taken out."""

    def __init__(self, parser: ToolParser, parallel: bool = True):
        self.parser = parser
        self.parallel = parallel  # False: the first call only (parallel_tool_calls false)
        self.state = "text"  # text: no call yet | calls: the format's calls started | plain: none can come
        self.pending = ""  # text held back (a marker may be starting)
        self.tool_text = ""  # from the first marker on
        self.found = 0  # calls found so far (handed out, or dropped when not parallel)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.state == "plain":
            return text, []
        if self.state == "text":
            content = self._before_calls(text)
            if self.state != "calls":
                return content, []
            return content, self._new_calls(self.parser.parse(self.tool_text, final=False))
        self.tool_text += text
        if _CLOSERS.isdisjoint(text):
            return "", []
        return "", self._new_calls(self.parser.parse(self.tool_text, final=False))

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

    def _new_calls(self, parsed) -> list[ToolCall]:
        new = parsed.calls[self.found:]
        self.found = len(parsed.calls)
        if not self.parallel:
            new = new[:max(0, 1 - (self.found - len(new)))]
        return [ToolCall(new_call_id(self.parser.mistral_ids), name, arguments) for name, arguments in new]

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self.state != "calls":
            content, self.pending = self.pending, ""
            return content, []
        parsed = self.parser.parse(self.tool_text, final=True)
        if not parsed.calls:  # malformed: what the model wrote is its answer
            return self.tool_text, []
        rest = self.tool_text[parsed.end:]
        return (rest if rest.strip() else ""), self._new_calls(parsed)


class NamedCall:
    """``tool_choice`` naming a function: the whole output is its arguments (constrained to them)."""

    def __init__(self, name: str):
        self.name = name
        self.arguments = ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.arguments += text
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        return "", [ToolCall(new_call_id(), self.name, self.arguments)]


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
            content, calls = self.tools.finish()
            delta.content += content
            delta.tool_calls += calls
            self.calls += calls
        return delta

    def end(self, rest: str) -> Delta:
        """The answer's last text (held back for a stop string) and whatever the parsers still hold."""
        delta, last = self.feed(rest), self.finish()
        return Delta(delta.content + last.content, delta.reasoning + last.reasoning,
                     delta.tool_calls + last.tool_calls)

    def finish_reason(self, reason: str) -> str:
        """OpenAI's: "tool_calls" for an answer that called tools and ended by itself; a named
        call keeps its own ("stop"), as OpenAI's does."""
        called = self.calls and not isinstance(self.tools, NamedCall)
        return "tool_calls" if called and reason in ("eos", "stop") else reason

    def _content(self, reasoning: str, content: str) -> Delta:
        calls = []
        if self.tools is not None and content:
            content, calls = self.tools.feed(content)
            self.calls += calls
        return Delta(content, reasoning, calls)
