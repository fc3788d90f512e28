"""The tool-call formats models write, by vLLM's ``--tool-call-parser`` names.

A parser sees the text from where the calls start (its ``starts`` marker: text before it is
content) and returns the calls written in full so far, and how much text they took. It is asked
again as more text comes (``final`` False: only finished calls count) and once at the end
(``final`` True: a last call whose closing tag the stop token cut off counts too). What does not
parse is never an error: ``splitserve.gateway.chat_output.stream`` gives it back as content.

The JSON formats also find a call still being written (``partial``): its name, once written in
full before its arguments, and where its arguments object begins, so that the stream can send
the arguments as they come (vLLM streams them so too). The formats whose arguments are not JSON
(``qwen3_xml``, ``pythonic``) write the JSON of those written so far (``partial_arguments``).

* ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated;
* ``qwen3_xml`` / ``qwen3_coder`` (Qwen3-Coder): ``<tool_call><function=NAME><parameter=P>value
  </parameter>...</function></tool_call>``, values read by the tool's parameter types;
* ``llama3_json`` (Llama 3.1-3.3): the answer is ``{"name": ..., "parameters": {...}}`` (after an
  optional ``<|python_tag|>``), several separated by ``;``;
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` per call;
* ``pythonic`` (Llama 3.2 / 4, ToolACE): the answer is ``[f(a=1, b="x"), g()]``, Python syntax
  (splitserve.gateway.chat_output.python_calls reads it as it is written).

``required_calls`` reads what ``tool_choice: "required"`` constrains the output to (a JSON array
of ``{"name", "parameters"}``); it is not a ``--tool-call-parser``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from splitserve.gateway.chat_output.python_calls import CallList
from splitserve.gateway.chat_output.reasoning import held_back
from splitserve.gateway.chat_output.tools import Function

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")


@dataclass
class Parsed:
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments as JSON text), in order
    end: int = 0  # characters of the text those calls (and what wraps them) take


def _arguments(value: Any) -> str | None:
    """A call's arguments as JSON text of an object; None when they are not an object (a
    malformed call). Models write them as an object, or as JSON text of one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _json_call(value: Any, argument_keys: Sequence[str]) -> tuple[str, str] | None:
    """``{"name": ..., <one of argument_keys>: {...}}`` -> (name, arguments); None if malformed."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    given = next((value[k] for k in argument_keys if k in value), {})
    arguments = _arguments(given)
    return None if arguments is None else (value["name"], arguments)


def _skip_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()


def _name_then_arguments(keys: Sequence[str]) -> str:
    """A call object's beginning, ``{"name": "NAME", "<key>": `` up to its arguments' ``{``."""
    return (r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)+)"\s*,\s*"(?:' + "|".join(map(re.escape, keys))
            + r')"\s*:\s*(?=\{)')


def _partial_match(pattern: re.Pattern, text: str, pos: int) -> tuple[str, int] | None:
    """(name, where the arguments begin) of a call ``pattern`` finds at ``pos`` (group 1: the name
    as JSON string content)."""
    match = pattern.match(text, pos)
    if match is None:
        return None
    try:
        name = json.loads(f'"{match.group(1)}"')
    except json.JSONDecodeError:
        return None
    return name, match.end()


class ToolParser:
    """One format. ``starts``: the markers where calls begin; ``at_start_only``: only when the
    answer begins with one (its formats have no tag: a ``{`` or ``[`` later is text)."""

    name = ""
    starts: tuple[str, ...] = ()
    at_start_only = False
    closers = "}])>"  # a call can only have been finished by text holding one of these
    mistral_ids = False  # call ids in Mistral's shape (its templates check them)

    def __init__(self, functions: Sequence[Function] = ()):
        self.functions = {f.name: f for f in functions}

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def partial(self, text: str, pos: int) -> tuple[str, int] | None:
        """A call begun at ``pos`` (where the finished calls end): its name and where its arguments
        object begins, once both are written; None until then, and for formats whose arguments
        are not the model's JSON text (``partial_arguments``, or they come whole)."""
        return None

    def partial_arguments(self, text: str, pos: int) -> tuple[str, str] | None:
        """For formats whose arguments the parser writes as JSON itself: a call begun at ``pos``,
        its name and the JSON text of its arguments so far — a prefix of what ``parse`` will give
        once the call is whole, growing as text comes. None until the name is written."""
        return None


class _JsonArray(ToolParser):
    """A JSON array of call objects, read one element at a time, so that each call counts as soon
    as its object closes."""

    argument_keys: tuple[str, ...] = ("arguments", "parameters")
    opening = r"\["  # what opens the array (a regular expression)

    def partial(self, text: str, pos: int) -> tuple[str, int] | None:
        # Before the first element: what opens the array; after one: its comma.
        pattern = re.compile(r"\s*(?:" + self.opening + r")?\s*,?\s*" + _name_then_arguments(self.argument_keys), re.S)
        return _partial_match(pattern, text, pos)

    def parse_array(self, text: str, pos: int) -> Parsed:
        """``text[pos:]`` starts the array's ``[``."""
        parsed = Parsed()
        if not text.startswith("[", pos):
            return parsed
        pos += 1
        while True:
            pos = _skip_space(text, pos)
            if text.startswith("]", pos):
                parsed.end = pos + 1
                return parsed
            try:
                value, pos = _DECODER.raw_decode(text, pos)
            except json.JSONDecodeError:
                return parsed
            call = _json_call(value, self.argument_keys)
            if call is None:
                return parsed
            parsed.calls.append(call)
            parsed.end = pos
            pos = _skip_space(text, pos)
            if text.startswith(",", pos):
                pos += 1


class RequiredCalls(_JsonArray):
    """What ``tool_choice: "required"`` constrains the output to."""

    name = "required"
    starts = ("[",)
    at_start_only = True
    argument_keys = ("parameters",)

    def parse(self, text: str, final: bool) -> Parsed:
        return self.parse_array(text, 0)


class Hermes(ToolParser):
    name = "hermes"
    starts = ("<tool_call>",)
    _block = re.compile(r"\s*<tool_call>\s*(.*?)\s*</tool_call>", re.S)
    _open = re.compile(r"\s*<tool_call>\s*(.*?)\s*$", re.S)
    _partial = re.compile(r"\s*<tool_call>\s*" + _name_then_arguments(("arguments", "parameters")), re.S)

    def partial(self, text: str, pos: int) -> tuple[str, int] | None:
        return _partial_match(self._partial, text, pos)

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = Parsed()
        while (match := self._block.match(text, parsed.end)) is not None:
            call = self.call(match.group(1))
            if call is None:
                return parsed
            parsed.calls.append(call)
            parsed.end = match.end()
        if final and (match := self._open.match(text, parsed.end)) is not None:  # the closing tag never came
            call = self.call(match.group(1))
            if call is not None:
                parsed.calls.append(call)
                parsed.end = len(text)
        return parsed

    def call(self, body: str) -> tuple[str, str] | None:
        try:
            return _json_call(json.loads(body), ("arguments", "parameters"))
        except json.JSONDecodeError:
            return None


class Qwen3Xml(ToolParser):
    name = "qwen3_xml"
    starts = ("<tool_call>",)
    _block = re.compile(r"\s*<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
    _open = re.compile(r"\s*<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.S)
    _parameter = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = Parsed()
        while (match := self._block.match(text, parsed.end)) is not None:
            parsed.calls.append(self.call(match.group(1), match.group(2)))
            parsed.end = match.end()
        if final and (match := self._open.match(text, parsed.end)) is not None:
            parsed.calls.append(self.call(match.group(1), match.group(2)))
            parsed.end = len(text)
        return parsed

    _open_call = re.compile(r"\s*<tool_call>\s*<function=([^>\n]+)>", re.S)
    _open_parameter = re.compile(r"<parameter=([^>\n]+)>\n?", re.S)

    def call(self, name: str, body: str) -> tuple[str, str]:
        name = name.strip()
        properties = self._properties(name)
        arguments = {}
        for match in self._parameter.finditer(body):
            key = match.group(1).strip()
            arguments[key] = self.value(match.group(2), properties.get(key, {}))
        return name, json.dumps(arguments, ensure_ascii=False)

    def _properties(self, name: str) -> dict:
        return self.functions[name].parameters.get("properties", {}) if name in self.functions else {}

    def partial_arguments(self, text: str, pos: int) -> tuple[str, str] | None:
        """The parameters written in full, as ``call`` writes them; then, of a string parameter
        being written, its key and its text so far (less what may yet be the closing tag or the
        newline before it). Other types wait for their closing tag (their JSON needs the whole
        value). A key written twice makes the whole call's JSON differ from this (the later value
        wins there): the stream then sends no more of it."""
        opened = self._open_call.match(text, pos)
        if opened is None:
            return None
        name = opened.group(1).strip()
        properties = self._properties(name)
        body_start = opened.end()
        closed = text.find("</function>", body_start)
        body = text[body_start:closed if closed >= 0 else len(text)]
        pieces, end = [], 0
        for match in self._parameter.finditer(body):
            key = match.group(1).strip()
            pieces.append(f"{json.dumps(key, ensure_ascii=False)}: "
                          f"{json.dumps(self.value(match.group(2), properties.get(key, {})), ensure_ascii=False)}")
            end = match.end()
        prefix = "{" + ", ".join(pieces)
        if closed >= 0:
            return name, prefix
        current = self._open_parameter.search(body, end)
        if current is None:
            return name, prefix
        key = current.group(1).strip()
        schema = properties.get(key, {})
        kind = schema.get("type") if isinstance(schema, dict) else None
        prefix += (", " if pieces else "") + json.dumps(key, ensure_ascii=False) + ": "
        if kind != "string" and not (isinstance(kind, list) and "string" in kind):
            return name, prefix
        value = body[current.end():]
        value = value[:len(value) - held_back(value, ("\n</parameter>", "</parameter>"))]
        if value.endswith("\n"):
            value = value[:-1]
        return name, prefix + json.dumps(value, ensure_ascii=False)[:-1]

    @staticmethod
    def value(text: str, schema: dict) -> Any:
        """A parameter's text as its schema's type says (text stays text when it does not parse)."""
        kind = schema.get("type") if isinstance(schema, dict) else None
        if kind == "string" or (isinstance(kind, list) and "string" in kind):
            return text
        if text.strip() == "null":
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            if kind == "boolean" and text.strip().lower() in ("true", "false"):
                return text.strip().lower() == "true"
            return text


class Qwen3Coder(Qwen3Xml):
    name = "qwen3_coder"


class Llama3Json(ToolParser):
    name = "llama3_json"
    starts = ("<|python_tag|>", "{")
    at_start_only = True
    _partial = re.compile(r"(?:<\|python_tag\|>)?\s*;?\s*" + _name_then_arguments(("parameters", "arguments")), re.S)

    def partial(self, text: str, pos: int) -> tuple[str, int] | None:
        return _partial_match(self._partial, text, pos)

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = Parsed()
        pos = len("<|python_tag|>") if text.startswith("<|python_tag|>") else 0
        while True:
            pos = _skip_space(text, pos)
            try:
                value, pos = _DECODER.raw_decode(text, pos)
            except json.JSONDecodeError:
                return parsed
            call = _json_call(value, ("parameters", "arguments"))
            if call is None:
                return parsed
            parsed.calls.append(call)
            parsed.end = pos
            pos = _skip_space(text, pos)
            if not text.startswith(";", pos):
                return parsed
            pos += 1


class Mistral(_JsonArray):
    name = "mistral"
    starts = ("[TOOL_CALLS]",)
    mistral_ids = True
    opening = r"\[TOOL_CALLS\]\s*\["
    _marker = "[TOOL_CALLS]"
    _named = re.compile(r"\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]")
    _named_partial = re.compile(r"\s*(?:\[TOOL_CALLS\])?\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]\s*(?=\{)")

    def partial(self, text: str, pos: int) -> tuple[str, int] | None:
        if text.startswith("[", _skip_space(text, len(self._marker))):  # the older shape: a JSON array
            return super().partial(text, pos)
        match = self._named_partial.match(text, pos)
        return (match.group(1), match.end()) if match is not None else None

    def parse(self, text: str, final: bool) -> Parsed:
        pos = _skip_space(text, len(self._marker))
        if text.startswith("[", pos):  # the older shape: one JSON array of calls
            return self.parse_array(text, pos)
        parsed = Parsed()
        while True:  # the newer: [TOOL_CALLS]name[ARGS]{...} per call
            match = self._named.match(text, pos)
            if match is None:
                return parsed
            try:
                value, end = _DECODER.raw_decode(text, _skip_space(text, match.end()))
            except json.JSONDecodeError:
                return parsed
            arguments = _arguments(value)
            if arguments is None:
                return parsed
            parsed.calls.append((match.group(1), arguments))
            parsed.end = end
            pos = _skip_space(text, end)
            if not text.startswith(self._marker, pos):
                return parsed
            pos += len(self._marker)


class Pythonic(ToolParser):
    name = "pythonic"
    starts = ("<|python_start|>", "[")
    at_start_only = True
    closers = ",]"
    _end_marker = "<|python_end|>"

    def __init__(self, functions: Sequence[Function] = ()):
        super().__init__(functions)
        self._list = CallList()  # its place in the text, kept between calls (one parser per stream)

    def parse(self, text: str, final: bool) -> Parsed:
        calls, end = self._list.scan(text).calls(final)
        if self._list.closed == end and text[end:].lstrip().startswith(self._end_marker):
            end = len(text) - len(text[end:].lstrip()) + len(self._end_marker)
        return Parsed(calls, end)

    def partial_arguments(self, text: str, pos: int) -> tuple[str, str] | None:
        return self._list.scan(text).being_written(pos)


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (Hermes, Qwen3Xml, Qwen3Coder, Llama3Json, Mistral,
                                                                Pythonic)}
