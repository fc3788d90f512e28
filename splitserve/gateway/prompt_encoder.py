"""A request's prompt as token ids: large text and chat prompts are encoded off the event loop.

A text prompt at the size limit takes a few hundred ms to encode (SmolLM2, 650 KB: 0.3 s): such
prompts are encoded on a few threads beside the event loop (a fast tokenizer lets go of the GIL
while it encodes), so every other stream of the gateway goes on meanwhile. Past
MAX_TOKENIZE_WAITING prompts waiting for one, more are refused at once (RESOURCE_EXHAUSTED), as a
full queue is. Chat messages go through the model's own template (its tools, documents and
variables).

A request of at most INLINE_ENCODE_BYTES is encoded on the event loop instead: SmolLM2's tokenizer
takes 0.2 us a character (a 1.7 KB prompt 0.28 ms, a small chat 0.25 ms with its template), less
than the trip to a thread and back costs on a loaded box. Under ``vllm bench serve`` at 2 req/s
on 2 cores, with the engine stepping beside the gateway, that trip took 4 ms (median, from the
endpoint's call to the ids in hand) for prompts of 36-252 tokens.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import jinja2

from splitserve.common.errors import InvalidArgument, ResourceExhausted
from splitserve.gateway.chat_template import template_kwargs
from splitserve.v1 import generation_pb2
from splitserve.wire import prompt_from_request, struct_to_python

TOKENIZE_THREADS = 2
MAX_TOKENIZE_WAITING = 64
# Requests up to this many bytes (serialized: the prompt, messages, tools...) are encoded inline,
# holding the event loop for ~1 ms at most.
INLINE_ENCODE_BYTES = 4096


class PromptEncoder:
    def __init__(self, tokenizer, vocab_size: int):
        """``vocab_size``: the model's (token id prompts are checked against it)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._threads = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")
        self._encoding = asyncio.Semaphore(TOKENIZE_THREADS)
        self.waiting = 0  # prompts waiting for (or on) an encoder thread

    async def token_ids(self, request) -> list[int]:
        """The prompt of a GenerateRequest or TokenizeRequest as token ids (its size was checked
        before: ``splitserve.wire.check_sizes``)."""
        kind, prompt = prompt_from_request(request, vocab_size=self.vocab_size)
        if kind != "messages":
            given = {"chat_template_kwargs": request.chat_template_kwargs.fields, "tools": request.tools,
                     "documents": request.documents}
            for name, value in given.items():
                if len(value):
                    raise InvalidArgument(f"{name}: only with messages (a chat template renders them)")
        if kind == "token_ids":
            return list(prompt)
        if request.ByteSize() <= INLINE_ENCODE_BYTES:
            return self._encode(request, kind, prompt)
        if self.waiting >= MAX_TOKENIZE_WAITING:
            raise ResourceExhausted(f"{self.waiting} prompts are waiting to be tokenized on this gateway; "
                                    "retry shortly or send it to another gateway")
        self.waiting += 1
        try:
            async with self._encoding:
                return await asyncio.get_running_loop().run_in_executor(self._threads, self._encode, request, kind,
                                                                        prompt)
        finally:
            self.waiting -= 1

    def _encode(self, request, kind: str, prompt) -> list[int]:
        # A Tokenize call may ask for other choices than Generate makes; unset, it gets Generate's.
        tokenize = isinstance(request, generation_pb2.TokenizeRequest)
        special = request.add_special_tokens if tokenize and request.HasField("add_special_tokens") else None
        if kind == "messages":
            add_prompt = request.add_generation_prompt if tokenize else True
            variables = template_kwargs(self.tokenizer, request.chat_template_kwargs)
            # Passed as transformers takes them (None: the template's own "no tools" branch).
            tools = [struct_to_python(tool) for tool in request.tools] or None
            documents = [struct_to_python(document) for document in request.documents] or None
            try:
                text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=add_prompt,
                                                          tools=tools, documents=documents, **variables)
            except jinja2.TemplateError as e:  # the model's template refuses this conversation
                raise InvalidArgument(f"messages: the model's chat template refused them: {e}") from e
            return self.tokenizer.encode(text, add_special_tokens=bool(special))
        return self.tokenizer.encode(prompt, add_special_tokens=special is not False)
