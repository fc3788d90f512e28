"""Structured output: constrain what a request may generate to a JSON schema, any JSON object,
a regular expression or a fixed list of choices. This module is the request's spec alone
(``StructuredOutput``: no grammar library, no torch, so the gateway builds it for every request);
the grammar library's side is ``splitserve.engine.grammar``.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice")


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of the four constraints.

    ``json_schema`` is the schema as JSON text (an object or a boolean schema); ``json_object``
    asks for any JSON object; ``regex`` for text matching the expression (xgrammar's syntax,
    close to Python's); ``choice`` for exactly one of the strings.

    ``resumed_tokens``: how many tokens at the end of the prompt were generated earlier under
    this same constraint (a request retried on another worker carries its streamed tokens in
    its prompt): the matcher replays them before constraining the next token. Not part of the
    grammar's identity (``key``).

    ``after_token_ids``: the constraint starts once the output has written these tokens (a
    reasoning model's ``</think>``: its thinking is free text, its answer follows the schema).
    ``after_opener``: set, only an output whose first token is this one (``<think>``) waits for
    ``after_token_ids``; any other first token is constrained at once (a model that may or may
    not think first: Qwen3). Not part of the grammar's identity either.
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    resumed_tokens: int = 0
    after_token_ids: tuple[int, ...] = ()
    after_opener: int | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise ValueError(f"structured_output.choice must be a list of strings, got {self.choice!r}")
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_output.choice must be a non-empty list of non-empty strings, "
                                 f"got {list(self.choice)!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_output must set exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_output.json_object must be a bool, got {self.json_object!r}")
        for name in ("json_schema", "regex"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_output.{name} must be a non-empty string, got {value!r}")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_output.json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_output.json_schema must be a JSON object (a schema), got "
                                 f"{type(schema).__name__}")
        if isinstance(self.resumed_tokens, bool) or not isinstance(self.resumed_tokens, int) \
                or self.resumed_tokens < 0:
            raise ValueError(f"structured_output.resumed_tokens must be an int >= 0, got {self.resumed_tokens!r}")
        object.__setattr__(self, "after_token_ids", tuple(self.after_token_ids))
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.after_token_ids):
            raise ValueError(f"structured_output.after_token_ids must be token ids, got {self.after_token_ids!r}")
        if self.after_opener is not None and (not isinstance(self.after_opener, int) or self.after_opener < 0
                                              or not self.after_token_ids):
            raise ValueError(f"structured_output.after_opener must be a token id, with after_token_ids, got "
                             f"{self.after_opener!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on (the compiler's cache key)."""
        return self.kind, getattr(self, self.kind)

    def resumed(self, tokens: int) -> "StructuredOutput":
        """The same constraint for a retry whose prompt ends with ``tokens`` generated ones."""
        return dataclasses.replace(self, resumed_tokens=tokens)
