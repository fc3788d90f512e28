"""A request's tools and ``tool_choice`` (OpenAI's rules, as vLLM applies them).

* ``none``: the tools are shown to the model (its chat template renders them); its output is text.
* ``auto`` (the default when tools are given): the model decides; its output is parsed by the
  server's ``--tool-call-parser`` and needs ``--enable-auto-tool-choice``, as in vLLM.
* ``required`` and a named function: the output is *constrained* (structured output) to a JSON
  array of calls (``[{"name": ..., "parameters": {...}}]``) or to the named function's arguments,
  so it always parses and validates, whatever the model; no parser is needed.
"""
from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from splitserve.common.errors import InvalidArgument

MODES = ("none", "auto", "required")
# Arguments of a tool without ``parameters``: an object with anything in it.
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made."""

    id: str  # unique within the answer; a later turn's tool result names it (tool_call_id)
    name: str  # the function's name, as the model wrote it
    arguments: str  # the arguments: a JSON object, as text

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallPart:
    """A piece of a call as it streams (OpenAI's ``delta.tool_calls`` entries): the call's first
    part has its id and name, the others a fragment of its arguments' JSON text each; a call's
    fragments, joined, are its arguments object as the model wrote it."""

    index: int  # the call's place in the answer (0, 1, ...)
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id(mistral: bool = False) -> str:
    """``call_`` and 24 hex digits; Mistral's templates accept only 9 letters or digits."""
    if mistral:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Function:
    """A tool the request offers (only functions exist in OpenAI's API)."""

    name: str
    parameters: dict  # JSON schema of the arguments object


def functions_of(tools: Sequence[dict]) -> list[Function]:
    """The request's tools, checked for OpenAI's shape ``{"type": "function", "function": {"name",
    "description", "parameters"}}``; a 400 names the first field that is wrong."""
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type", "function") != "function":
            raise InvalidArgument(f"{where}.type: only \"function\" tools exist, got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidArgument(f"{where}.function: an object with the function's name is required")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"{where}.function.name: a non-empty string is required")
        parameters = function.get("parameters", ANY_OBJECT)
        if parameters is None:
            parameters = ANY_OBJECT
        if not isinstance(parameters, dict):
            raise InvalidArgument(f"{where}.function.parameters: a JSON schema (an object) is required")
        if any(f.name == name for f in functions):
            raise InvalidArgument(f"{where}.function.name: {name!r} is offered twice")
        functions.append(Function(name, parameters))
    return functions


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # none | auto | required | function
    function: Function | None = None  # mode "function": the one to call
    parallel: bool = True  # more than one call per answer may come


def resolve_tool_choice(mode: str, function: str, functions: Sequence[Function], parallel: bool | None,
                        auto_enabled: bool) -> ToolChoice:
    """The choice a request makes: ``mode`` ("", "none", "auto", "required") or ``function`` (a
    name); unset, "auto" with tools and "none" without. ``auto_enabled``: the server parses tool
    calls (``--enable-auto-tool-choice`` with a ``--tool-call-parser``)."""
    if mode and function:
        raise InvalidArgument("tool_choice: give a mode or a function, not both")
    if mode and mode not in MODES:
        raise InvalidArgument(f"tool_choice: must be \"none\", \"auto\", \"required\" or a function, got {mode!r}")
    if not functions:
        if function or mode in ("auto", "required"):
            raise InvalidArgument(f"tool_choice: {json.dumps(function or mode)} needs tools")
        return ToolChoice("none")
    parallel = True if parallel is None else parallel
    if function:
        chosen = next((f for f in functions if f.name == function), None)
        if chosen is None:
            raise InvalidArgument(f"tool_choice: no tool is named {function!r} (tools: "
                                  f"{', '.join(f.name for f in functions)})")
        return ToolChoice("function", chosen, parallel)
    mode = mode or "auto"
    if mode == "auto" and not auto_enabled:
        raise InvalidArgument("tool_choice: \"auto\" (the default with tools) needs a server started with "
                              "--enable-auto-tool-choice and a --tool-call-parser; give \"none\", \"required\" "
                              "or a named function instead")
    return ToolChoice(mode, None, parallel)


def constraint_schema(choice: ToolChoice, functions: Sequence[Function]) -> str | None:
    """The JSON schema the output must follow for ``required`` and a named function (None for
    the others): a named function's arguments; for ``required`` an array of at least one call
    (one at most without parallel calls), each ``{"name": <a tool's name>, "parameters": <its
    arguments>}`` -- vLLM's shape."""
    if choice.mode == "function":
        return json.dumps(choice.function.parameters)
    if choice.mode != "required":
        return None
    calls: dict[str, Any] = {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [f.name]}, "parameters": f.parameters},
         "required": ["name", "parameters"]}
        for f in functions]}
    schema: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
    if not choice.parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)
