"""OpenAI request bodies (as vLLM accepts them) and their translation into ``GenerateRequest``s.

The bodies are checked for shape here (pydantic: a wrong type is a 400 naming the field);
every value check lives in the one validation of the gRPC API, reached through the
``GenerateRequest`` these produce. Fields OpenAI defines that splitserve does not implement
are refused with a 400 naming them, never ignored: a caller relying on them must know.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from splitserve.gateway.openai_api.structured import structured_output
from splitserve.gateway.samples import MAX_N
from splitserve.common.errors import InvalidArgument
from splitserve.v1 import generation_pb2

# OpenAI's default max_tokens for /v1/completions is 16; chat has none (the model's room).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share (OpenAI's and vLLM's extra sampling parameters)."""

    # Unknown fields are kept so they can be named in a clear refusal (see ``unsupported``).
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    max_tokens: int | None = None
    min_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    priority: int = 0
    request_id: str | None = None
    return_token_ids: bool = False  # vLLM's: each choice (and stream chunk) also carries its token ids
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    # Structured output (splitserve.gateway.openai_api.structured): shapes are checked when translated.
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    structured_outputs: Any = None

    def unsupported(self, handled: tuple[str, ...] = ()) -> None:
        """A 400 for a field this server does not implement, set to anything that matters;
        ``handled``: those the endpoint checks itself."""
        for name in UNSUPPORTED_FIELDS:
            if name in handled:
                continue
            value = getattr(self, name) if name in type(self).model_fields else (self.model_extra or {}).get(name)
            if value not in _HARMLESS.get(name, (None, False, [], {})):
                raise InvalidArgument(f"{name}: not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise InvalidArgument("stream_options: only allowed when stream is true")

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> generation_pb2.SamplingParams:
        s = generation_pb2.SamplingParams(ignore_eos=self.ignore_eos)
        for name in ("min_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                     "presence_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                setattr(s, name, value)
        _set_int(s, "seed", self.seed, 0, 2**64 - 1)
        _set_int(s, "n", self.n, 1, MAX_N)
        _set_int(s, "max_tokens", max_tokens, 1, 2**32 - 1)
        _set_int(s, "logprobs", logprobs, 0, 2**32 - 1)
        if self.min_tokens is not None and self.min_tokens < 0:
            raise InvalidArgument(f"min_tokens must be >= 0, got {self.min_tokens}")
        s.stop.extend([self.stop] if isinstance(self.stop, str) else (self.stop or []))
        for i, tok in enumerate(self.stop_token_ids or []):
            if tok < 0:
                raise InvalidArgument(f"stop_token_ids[{i}] must be >= 0, got {tok}")
        s.stop_token_ids.extend(self.stop_token_ids or [])
        spec = structured_output({name: getattr(self, name) for name in STRUCTURED_OUTPUT_FIELDS})
        if spec is not None:
            s.structured_output.CopyFrom(spec)
        return s

    def request(self, sampling: generation_pb2.SamplingParams, request_id: str) -> generation_pb2.GenerateRequest:
        return generation_pb2.GenerateRequest(request_id=request_id, sampling=sampling, priority=self.priority)


# Fields of OpenAI's API (and vLLM's extras) that this server does not implement.
# (tools and tool_choice: a chat's own, handled there.)
UNSUPPORTED_FIELDS = ("logit_bias", "guided_grammar", "tools", "tool_choice", "functions", "function_call",
                "best_of", "suffix", "echo", "prompt_logprobs", "allowed_token_ids", "bad_words")
STRUCTURED_OUTPUT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "structured_outputs")
# Values of those fields that ask for nothing (best_of=1 is what every request does).
_HARMLESS = {"best_of": (None, 1)}


def _set_int(msg, name: str, value: int | None, lo: int, hi: int) -> None:
    if value is None:
        return
    if not lo <= value <= hi:
        raise InvalidArgument(f"{name} must be in [{lo}, {hi}], got {value}")
    setattr(msg, name, value)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # top alternatives per token (0: the sampled token's only)

    def to_generate(self, request_id: str) -> generation_pb2.GenerateRequest:
        self.unsupported()
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidArgument(f"prompt: one prompt per request is supported, got a batch of {len(prompt)}")
            prompt = prompt[0]
        if self.logprobs is not None and self.logprobs < 0:
            raise InvalidArgument(f"logprobs must be >= 0, got {self.logprobs}")
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        req = self.request(self.sampling(max_tokens, self.logprobs), request_id)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgument("prompt must not be empty")
            req.text = prompt
        else:
            if not prompt:
                raise InvalidArgument("prompt must not be empty")
            for i, tok in enumerate(prompt):
                if tok < 0:
                    raise InvalidArgument(f"prompt[{i}] must be a token id >= 0, got {tok}")
            req.token_ids.extend(prompt)
        return req


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None
    # A tool turn's answer to one call, and an assistant turn's calls (OpenAI's shapes).
    tool_call_id: str | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def text(self, i: int) -> str:
        if self.content is None:
            if self.tool_calls:  # an assistant turn that only called tools
                return ""
            raise InvalidArgument(f"messages[{i}].content: text content is required")
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def add_to(self, messages, i: int) -> None:
        """This turn as the gRPC request's ``ChatMessage``, appended to ``messages``."""
        message = messages.add(role=self.role, content=self.text(i), tool_call_id=self.tool_call_id or "",
                               name=self.name or "")
        for call in self.tool_calls or ():
            message.tool_calls.add().update(call)


def add_template_inputs(req, messages: list[ChatMessage], tools, documents, variables) -> None:
    """The chat and what its template reads besides (tools, documents, further variables) onto a
    gRPC GenerateRequest or TokenizeRequest."""
    for i, m in enumerate(messages):
        m.add_to(req.messages, i)
    for tool in tools or ():
        req.tools.add().update(tool)
    for document in documents or ():
        req.documents.add().update(document)
    req.chat_template_kwargs.update(variables or {})


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM's: further variables for the model's chat template (splitserve.gateway.chat_template).
    chat_template_kwargs: dict[str, Any] | None = None
    # Rendered into the prompt by the model's template; what tool_choice asks of the output is the
    # gateway's to enforce (splitserve.gateway.chat_output.tools), for gRPC and HTTP alike.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    documents: list[dict[str, Any]] | None = None  # vLLM's: retrieval results for templates that read them

    def to_generate(self, request_id: str) -> generation_pb2.GenerateRequest:
        self.unsupported(handled=("tools", "tool_choice"))
        if not self.add_generation_prompt:
            raise InvalidArgument("add_generation_prompt: only true is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidArgument("top_logprobs: requires logprobs to be true")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise InvalidArgument(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        req = self.request(self.sampling(max_tokens, logprobs), request_id)
        add_template_inputs(req, self.messages, self.tools, self.documents, self.chat_template_kwargs)
        self.add_tool_choice(req)
        return req

    def add_tool_choice(self, req: generation_pb2.GenerateRequest) -> None:
        """OpenAI's ``tool_choice`` ("none", "auto", "required" or ``{"type": "function", "function":
        {"name": ...}}``) and ``parallel_tool_calls`` onto the gRPC request."""
        if self.parallel_tool_calls is not None:
            req.parallel_tool_calls = self.parallel_tool_calls
        choice = self.tool_choice
        if choice is None:
            return
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if choice in ("none", "auto", "required"):
            req.tool_choice.mode = choice
            return
        if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str) or not name:
            raise InvalidArgument('tool_choice: must be "none", "auto", "required" or {"type": "function", '
                                  f'"function": {{"name": ...}}}}, got {json.dumps(choice)}')
        req.tool_choice.function = name


# ---- /tokenize and /detokenize (vLLM's bodies) ------------------------------------------

# Fields of vLLM's tokenize body that change the chat template's input: not implemented, so refused.
UNSUPPORTED_TOKENIZE_FIELDS = ("chat_template", "mm_processor_kwargs")


class TokenizeRequest(BaseModel):
    """Either ``prompt`` (text) or ``messages`` (rendered by the chat template), as vLLM takes them."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Unset: vLLM's (and Generate's) choice, special tokens for a prompt, none for messages.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None

    def to_proto(self) -> generation_pb2.TokenizeRequest:
        for name in UNSUPPORTED_TOKENIZE_FIELDS:
            if (self.model_extra or {}).get(name) not in (None, [], {}, ""):
                raise InvalidArgument(f"{name}: not supported by this server")
        if self.continue_final_message:
            raise InvalidArgument("continue_final_message: not supported by this server")
        if (self.prompt is None) == (self.messages is None):
            raise InvalidArgument("prompt: give either prompt (text) or messages")
        req = generation_pb2.TokenizeRequest()
        if self.add_special_tokens is not None:
            req.add_special_tokens = self.add_special_tokens
        if self.messages is not None and not self.messages:
            raise InvalidArgument("messages must not be empty")
        # With a prompt the template's inputs travel too: the gateway refuses them, naming each.
        add_template_inputs(req, self.messages or [], self.tools, self.documents, self.chat_template_kwargs)
        if self.prompt is not None:
            req.text = self.prompt
        else:
            req.add_generation_prompt = self.add_generation_prompt
        return req


class LoRAAdapterRequest(BaseModel):
    """vLLM's body of /v1/load_lora_adapter (both fields) and /v1/unload_lora_adapter (the name)."""

    lora_name: str
    lora_path: str | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]

    def to_proto(self) -> generation_pb2.DetokenizeRequest:
        for i, tok in enumerate(self.tokens):
            if tok < 0:
                raise InvalidArgument(f"tokens[{i}] must be a token id >= 0, got {tok}")
        return generation_pb2.DetokenizeRequest(token_ids=self.tokens)
