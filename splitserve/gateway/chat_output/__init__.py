"""What a chat answer holds besides text: tool calls and reasoning.

The model writes both as text in formats of its own (``<tool_call>{...}</tool_call>``,
``[TOOL_CALLS][...]``, ``<think>...</think>``); the gateway turns that text into OpenAI's
``tool_calls`` and ``reasoning_content`` for the gRPC and the HTTP API alike:

* ``tools`` -- the request's tools and ``tool_choice``: which calls it may make, and the JSON
  schema that makes ``required`` and a named choice always come out as a valid call;
* ``tool_parsers`` -- one parser per model family (``--tool-call-parser``, vLLM's names);
* ``reasoning`` -- ``--reasoning-parser``: the ``<think>`` family;
* ``stream`` -- ``ChatOutput``: one sample's text as it streams in, split into content,
  reasoning and whole tool calls.
"""
