"""Reading ``[f(a=1, b="x"), g()]`` (the ``pythonic`` tool-call format) while the model writes it.

``CallList`` keeps its place in the text between calls, so each character is scanned once however
many times the stream asks (a stream asks at every token): it tracks string literals and bracket
depth, and notes where each element of the list begins, where a call's ``(`` and each of its
arguments begin, and where a call's ``)`` ends it. A call counts once the ``,`` or ``]`` after its
``)`` is written; each element and each argument is read with ``ast`` once, when it is whole. What is not a call of
literal keyword arguments ends the list's calls there (the stream gives the rest back as content).
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

_NAME = re.compile(r"\s*[A-Za-z_][A-Za-z0-9_]*\s*")
_KEY = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=(?!=)\s*")
_JSON_LITERALS = {"true": True, "false": False, "null": None}  # what models write in Python calls too
_UNREADABLE = (ValueError, TypeError, SyntaxError, RecursionError, MemoryError)


def _literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except _UNREADABLE:
        if isinstance(node, ast.Name) and node.id in _JSON_LITERALS:
            return True, _JSON_LITERALS[node.id]
        return False, None


def read_call(text: str) -> tuple[str, str] | None:
    """``name(key=literal, ...)`` -> (name, arguments as JSON text); None if it is anything else."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except _UNREADABLE:
        return None
    if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None or keyword.arg in arguments:  # **kwargs, a keyword twice
            return None
        ok, arguments[keyword.arg] = _literal(keyword.value)
        if not ok:
            return None
    try:
        return node.func.id, json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError):  # a set or bytes literal: not JSON
        return None


def _read_argument(text: str) -> str | None:
    """``key=literal`` -> its JSON as ``json.dumps`` writes it inside the arguments object."""
    match = _KEY.match(text)
    if match is None:
        return None
    try:
        ok, value = _literal(ast.parse(text[match.end():].strip(), mode="eval").body)
        return f"{json.dumps(match.group(1), ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}" \
            if ok else None
    except _UNREADABLE:
        return None


def _open_string(quote: str, raw: str) -> str | None:
    """The text of a string literal begun with ``quote`` whose body so far is ``raw`` (an escape
    being written is left out until it is whole)."""
    if "\\" not in raw:
        return raw
    for cut in range(min(len(raw), 10) + 1):
        try:
            value = ast.literal_eval(quote + raw[:len(raw) - cut] + quote)
        except _UNREADABLE:
            continue
        return value if isinstance(value, str) else None
    return None


@dataclass
class _Element:
    start: int  # where the element begins (after "[" or ",")
    open: int = -1  # its "(" when a name comes before it (a call), else -1
    arguments: list[int] = field(default_factory=list)  # where each argument begins (after "(" or ",")
    end: int = -1  # after its ")": the call is written in full


class CallList:
    def __init__(self):
        self._reset("")

    def _reset(self, text: str) -> None:
        self.text = text
        self._i = 0
        self._depth = 0  # 0: before the list, 1: in it, 2: in a call's parentheses, more: within a value
        self._quote = ""  # the open string literal's quote ("" outside one)
        self._escaped = False
        self._string_start = -1
        self.closed = -1  # after the list's "]", once written
        self.broken = False  # an element that is not a call: nothing after it counts
        self.done: list[_Element] = []  # calls written in full, in order
        self.current: _Element | None = None  # the element being written
        self._calls: list[tuple[str, str] | None] = []  # read_call of each of ``done``, once asked
        self._arguments: dict[int, str | None] = {}  # _read_argument by where the argument begins

    def scan(self, text: str) -> "CallList":
        """Take in ``text`` (the whole tool text so far: it normally extends the last one)."""
        if not text.startswith(self.text):
            self._reset(text)
        self.text = text
        while self._i < len(text) and not self.broken and self.closed < 0:
            if not self._step(text, self._i):
                break
        return self

    def _step(self, text: str, i: int) -> bool:
        """Scan the character at ``i``; False to wait for more text before deciding."""
        c = text[i]
        if self._quote:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif text.startswith(self._quote, i):
                self._i, self._quote = i + len(self._quote), ""
                return True
            elif len(self._quote) == 3 and c == self._quote[0] and len(text) - i < 3:
                return False  # a triple quote may be closing
            self._i = i + 1
            return True
        self._i = i + 1
        if self._depth == 0:
            if c == "[":
                self._depth, self.current = 1, _Element(i + 1)
            return True
        element = self.current
        if c in "\"'":
            if len(text) - i < 3 and text[i:] == c * (len(text) - i):
                self._i = i
                return False  # "" may yet open a triple-quoted string
            self._quote = c * 3 if text.startswith(c * 3, i) else c
            self._string_start, self._i = i, i + len(self._quote)
        elif c in "([{":
            if self._depth == 1 and c == "(" and element.open < 0 and _NAME.fullmatch(text, element.start, i):
                element.open = i
                element.arguments.append(i + 1)
            self._depth += 1
        elif c in ")]}":
            self._depth -= 1
            if self._depth == 1 and c == ")" and element.open >= 0 and element.end < 0:
                element.end = i + 1
            elif self._depth == 0:
                self.closed = i + 1
                if element.end >= 0:
                    self.done.append(element)
                self.broken = element.end < 0 and bool(text[element.start:i].strip())
        elif c == "," and self._depth == 1:
            if element.end >= 0:
                self.done.append(element)
            self.broken = element.end < 0
            self.current = _Element(i + 1)
        elif c == "," and self._depth == 2 and element.open >= 0:
            element.arguments.append(i + 1)
        elif self._depth == 1 and element.end >= 0 and not c.isspace():
            self.broken = True  # something after a call's ")" within its element
        return True

    def call(self, k: int) -> tuple[str, str] | None:
        """``read_call`` of the k-th call written in full."""
        while len(self._calls) <= k:
            element = self.done[len(self._calls)]
            self._calls.append(read_call(self.text[element.start:element.end]))
        return self._calls[k]

    def calls(self, final: bool) -> tuple[list[tuple[str, str]], int]:
        """The calls written in full (each followed by its "," or the list's "]"; ``final``: also a
        last one whose "]" never came) up to the first that does not read, and where they end
        (after the list's "]" once it closed with nothing else in it)."""
        calls, end = [], 0
        last = self.current if final and self.closed < 0 and not self.broken else None
        if last is not None and last.end >= 0 and not self.text[last.end:].strip() and last not in self.done:
            self.done.append(last)
        for k, element in enumerate(self.done):
            call = self.call(k)
            if call is None:
                return calls, end
            calls.append(call)
            end = element.end
        if calls and self.closed >= 0 and not self.broken:
            end = self.closed
        return calls, end

    def being_written(self, pos: int) -> tuple[str, str] | None:
        """The call after those ending by ``pos``: its name and the JSON of its arguments so far, a
        prefix of what ``read_call`` gives once it is whole (a string argument's text as it comes;
        another value once whole); None until its "(" is written."""
        k = sum(1 for element in self.done if element.end <= pos)
        if k < len(self.done):
            return self.call(k)
        element = self.current
        if self.broken or self.closed >= 0 or element is None or element.open < 0:
            return None
        if element.end >= 0:  # written, its "," or "]" to come
            return read_call(self.text[element.start:element.end])
        text = self.text
        name = text[element.start:element.open].strip()
        pieces = []
        for start, comma in zip(element.arguments, element.arguments[1:]):
            if start not in self._arguments:
                self._arguments[start] = _read_argument(text[start:comma - 1])
            if self._arguments[start] is None:
                return name, "{" + ", ".join(pieces)
            pieces.append(self._arguments[start])
        built = "{" + ", ".join(pieces)
        key = _KEY.match(text, element.arguments[-1])
        if key is None:
            return name, built
        built += (", " if pieces else "") + json.dumps(key.group(1), ensure_ascii=False) + ": "
        if len(self._quote) == 1 and self._depth == 2 and self._string_start == key.end():
            value = _open_string(self._quote, text[self._string_start + 1:])
            if value is not None:
                built += json.dumps(value, ensure_ascii=False)[:-1]
        return name, built
