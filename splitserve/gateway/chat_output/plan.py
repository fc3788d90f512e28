"""What the gateway does with a request's output besides relaying its text: the server's parsers
(``ChatOutputs``, from its flags) and one request's choices (``OutputPlan``)."""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from typing import Sequence

from splitserve.gateway.chat_output.reasoning import PARSERS as REASONING_PARSERS
from splitserve.gateway.chat_output.reasoning import ReasoningMarkers, ThinkParser
from splitserve.gateway.chat_output.stream import ChatOutput, NamedCall, ToolStream
from splitserve.gateway.chat_output.tool_parsers import PARSERS as TOOL_PARSERS
from splitserve.gateway.chat_output.tool_parsers import RequiredCalls, ToolParser
from splitserve.gateway.chat_output.tools import (Function, ToolChoice, constraint_schema, functions_of,
                                                  resolve_tool_choice)
from splitserve.common.errors import InvalidArgument
from splitserve.engine.structured_output import StructuredOutput
from splitserve.wire import check_grammar_size, struct_to_python


@dataclass(frozen=True)
class OutputPlan:
    """One request's output handling, decided at admission."""

    choice: ToolChoice
    functions: tuple[Function, ...] = ()
    # JSON schema the output is constrained to (tool_choice required or a function), else None.
    constraint: str | None = None
    tool_parser: type[ToolParser] | None = None  # tool_choice auto: the server's parser
    reasoning: ThinkParser | None = None  # the server's reasoning parser, for a chat request
    prompt_state: str = ""  # whether the prompt left reasoning open (ReasoningMarkers.prompt_state)

    @property
    def needed(self) -> bool:
        """Whether the output is more than text (otherwise it is relayed as it comes)."""
        return self.choice.mode != "none" or self.reasoning is not None

    def output(self) -> ChatOutput | None:
        """A fresh parser for one sample's answer (None: relay the text as it is)."""
        if not self.needed:
            return None
        reasoning = self.reasoning.stream(self.prompt_state) if self.reasoning is not None else None
        tools = None
        if self.choice.mode == "function":
            tools = NamedCall(self.choice.function.name)
        elif self.choice.mode == "required":
            tools = ToolStream(RequiredCalls(self.functions), self.choice.parallel)
        elif self.choice.mode == "auto":
            tools = ToolStream(self.tool_parser(self.functions), self.choice.parallel)
        return ChatOutput(reasoning, tools)


@dataclass(frozen=True)
class ChatOutputs:
    """The gateway's parsers: ``--tool-call-parser``, ``--enable-auto-tool-choice``, ``--reasoning-parser``."""

    tool_parser: type[ToolParser] | None = None
    auto_tool_choice: bool = False
    reasoning: ThinkParser | None = None
    markers: ReasoningMarkers | None = field(default=None)

    @classmethod
    def from_flags(cls, tokenizer, tool_call_parser: str = "", enable_auto_tool_choice: bool = False,
                   reasoning_parser: str = "") -> "ChatOutputs":
        if enable_auto_tool_choice and not tool_call_parser:
            raise SystemExit("splitserve: --enable-auto-tool-choice needs a --tool-call-parser (how the model "
                             f"writes its calls: {', '.join(TOOL_PARSERS)})")
        reasoning = REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None
        return cls(TOOL_PARSERS[tool_call_parser] if tool_call_parser else None, enable_auto_tool_choice, reasoning,
                   ReasoningMarkers.of(tokenizer) if reasoning is not None else None)

    def plan(self, request, limits) -> OutputPlan:
        """A GenerateRequest's tools and tool_choice, checked (InvalidArgument naming the field);
        ``required`` and a named function become the request's constraint (the call's JSON
        schema), bounded by ``limits`` (``RequestLimits``) like a client's own schema."""
        plan = self._plan(request)
        if plan.constraint is not None:
            if request.sampling.HasField("structured_output"):
                raise InvalidArgument("sampling.structured_output: not with tool_choice \"required\" or a function, "
                                      "which constrain the output to the call themselves")
            request.sampling.structured_output.json_schema = plan.constraint
            check_grammar_size(request.sampling.structured_output, limits, path="tools")
        return plan

    def _plan(self, request) -> OutputPlan:
        chat = len(request.messages) > 0
        if len(request.tools) and not chat:
            raise InvalidArgument("tools: only with messages (a chat template renders them)")
        functions = functions_of([struct_to_python(tool) for tool in request.tools])
        mode = function = ""
        if request.HasField("tool_choice"):
            which = request.tool_choice.WhichOneof("choice")
            # An empty mode is no choice (proto3 cannot tell it from unset).
            mode, function = (request.tool_choice.mode, "") if which == "mode" else ("", request.tool_choice.function)
        parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else None
        choice = resolve_tool_choice(mode, function, functions, parallel,
                                     auto_enabled=self.auto_tool_choice and self.tool_parser is not None)
        return OutputPlan(choice, tuple(functions), constraint_schema(choice, functions),
                          self.tool_parser if choice.mode == "auto" else None,
                          self.reasoning if chat else None)

    def with_prompt(self, plan: OutputPlan, prompt: Sequence[int]) -> OutputPlan:
        """``plan`` knowing whether its prompt left reasoning open."""
        if plan.reasoning is None or self.markers is None:
            return plan
        return dataclasses.replace(plan, prompt_state=self.markers.prompt_state(prompt))

    def after_reasoning(self, plan: OutputPlan, spec: StructuredOutput) -> StructuredOutput:
        """``spec`` starting after the reasoning where the answer may begin with some: at once
        past ``</think>`` when the answer starts in reasoning; when the model may or may not think
        (Qwen3), past it only if its first token is ``<think>`` (one token in such models)."""
        if plan.reasoning is None or self.markers is None:
            return spec
        starts = plan.reasoning.starts_in_reasoning(plan.prompt_state)
        if starts:
            return dataclasses.replace(spec, after_token_ids=self.markers.end_ids)
        if starts is None and len(self.markers.start_ids) == 1:
            return dataclasses.replace(spec, after_token_ids=self.markers.end_ids,
                                       after_opener=self.markers.start_ids[0])
        return spec
