"""``--reasoning-parser``: the ``<think>...</think>`` family (vLLM's names).

* ``deepseek_r1``: the answer starts in reasoning (its chat template opens ``<think>`` in the
  prompt; older checkpoints write it first) and reasoning lasts until ``</think>``; an answer that
  never closes it is all reasoning.
* ``qwen3``: reasoning when the answer begins with ``<think>`` or the prompt left one open
  (Qwen3-2507's thinking models); otherwise the whole answer is content.

Both: when the prompt already closed the reasoning (Qwen3's ``enable_thinking: false`` renders
an empty ``<think></think>``), the answer is content. The prompt's state is read from its tokens
(``prompt_state``: whichever marker comes last), as vLLM does.

The same markers gate structured output: a constraint starts after ``</think>``
(``splitserve.engine.grammar``), so the thinking is free text and the answer follows the schema.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

START, END = "<think>", "</think>"


def held_back(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could be the start of one of ``markers``
    (held back while streaming, until the next text says whether a marker is coming)."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


@dataclass(frozen=True)
class ReasoningMarkers:
    """The markers as the model's tokenizer writes them (one added token each in reasoning models)."""

    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer) -> "ReasoningMarkers":
        return cls(tuple(tokenizer.encode(START, add_special_tokens=False)),
                   tuple(tokenizer.encode(END, add_special_tokens=False)))

    def prompt_state(self, prompt: Sequence[int]) -> str:
        """"open" (the prompt ends inside reasoning), "closed" (it ended it), or "" (neither
        marker): the one that comes last decides."""
        start, end = _last(prompt, self.start_ids), _last(prompt, self.end_ids)
        if start < 0 and end < 0:
            return ""
        return "open" if start > end else "closed"


def _last(ids: Sequence[int], sub: Sequence[int]) -> int:
    n = len(sub)
    if not n:
        return -1
    first = sub[0]
    for i in range(len(ids) - n, -1, -1):
        if ids[i] == first and tuple(ids[i:i + n]) == tuple(sub):
            return i
    return -1


class ThinkParser:
    """One family: whether an answer with no ``<think>`` of its own starts in reasoning."""

    name = ""
    reasons_unprompted = False  # with neither marker in the prompt, the answer starts in reasoning

    def starts_in_reasoning(self, prompt_state: str) -> bool | None:
        """True or False when the prompt decides; None: the answer's first characters do."""
        if prompt_state:
            return prompt_state == "open"
        return True if self.reasons_unprompted else None

    def stream(self, prompt_state: str) -> "ReasoningStream":
        return ReasoningStream(self.starts_in_reasoning(prompt_state))


class DeepSeekR1(ThinkParser):
    name = "deepseek_r1"
    reasons_unprompted = True


class Qwen3(ThinkParser):
    name = "qwen3"


PARSERS: dict[str, type[ThinkParser]] = {p.name: p for p in (DeepSeekR1, Qwen3)}


class ReasoningStream:
    """One answer's text, as it comes, split into reasoning and content."""

    def __init__(self, reasoning: bool | None):
        self.state = {True: "reasoning", False: "content", None: "undecided"}[reasoning]
        self.pending = ""  # text held back: a marker may be starting
        self.began = False  # the reasoning's own <think> was dropped already (or cannot come)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that can be shown now."""
        self.pending += text
        reasoning = content = ""
        if self.state == "undecided":
            head = self.pending.lstrip()
            if not head or (START.startswith(head) and head != START):
                return "", ""  # still could be <think>
            self.state = "reasoning" if head.startswith(START) else "content"
        if self.state == "reasoning":
            if not self.began:
                head = self.pending.lstrip()
                if not head or (START.startswith(head) and head != START):
                    return "", ""
                if head.startswith(START):
                    self.pending = head[len(START):]
                self.began = True
            end = self.pending.find(END)
            if end < 0:
                keep = held_back(self.pending, [END])
                reasoning, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
                return reasoning, ""
            reasoning, self.pending = self.pending[:end], self.pending[end + len(END):]
            self.state = "content"
        content, self.pending = self.pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning that never closed stays reasoning."""
        rest, self.pending = self.pending, ""
        if self.state != "reasoning":
            return "", rest
        if not self.began and rest.lstrip().startswith(START):
            rest = rest.lstrip()[len(START):]
        return rest, ""
