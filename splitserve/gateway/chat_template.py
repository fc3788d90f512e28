"""Variables a request adds to the model's chat template (vLLM's ``chat_template_kwargs``).

A template may read variables beyond the conversation: Qwen3's ``enable_thinking``, a system
prompt switch, a date. A request names them in ``chat_template_kwargs``; the gateway passes on
only those the model's template reads (found by parsing it once), as vLLM does, so a client that
sends ``enable_thinking`` to every model does not fail on the ones without it. Names the gateway
sets itself are refused: a request must not replace its own conversation, the template, or the
tokenizer's special tokens through them.
"""
from __future__ import annotations

import functools

import jinja2
import jinja2.meta
from google.protobuf import struct_pb2

from splitserve.common.errors import InvalidArgument
from splitserve.wire import struct_to_python

# Arguments of ``apply_chat_template`` and variables transformers fills in from the tokenizer.
RESERVED = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
    "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
    "raise_exception", "strftime_now"})


def template_kwargs(tokenizer, kwargs: struct_pb2.Struct) -> dict:
    """The request's template variables that the tokenizer's chat template reads, as Python
    values (JSON numbers that are whole come back as ints: a template may ``range`` over one)."""
    if not kwargs.fields:
        return {}
    for name in kwargs.fields:
        if name in RESERVED:
            raise InvalidArgument(f"chat_template_kwargs.{name}: set by the server, not by a request")
    read = template_variables(_template_source(tokenizer))
    return {name: value for name, value in struct_to_python(kwargs).items() if read is None or name in read}


def _template_source(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    # A tokenizer may carry several named templates ("default", "tool_use"): any of them may be used.
    return "\n".join(template.values()) if isinstance(template, dict) else template


@functools.lru_cache(maxsize=8)
def template_variables(source: str) -> frozenset[str] | None:
    """Names a Jinja template reads without defining them; None when this parser cannot read it
    (transformers renders with tags of its own, e.g. ``{% generation %}``): then every name a
    request gives is passed on, and the template ignores those it does not read."""
    if not source:
        return frozenset()
    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateSyntaxError:
        return None
    return frozenset(jinja2.meta.find_undeclared_variables(parsed))

