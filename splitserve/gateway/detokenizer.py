"""Streaming text for the gateway: token ids -> text deltas, and stop strings over those deltas.

Both classes exist because streaming cannot simply decode each new token on its own:

* a token may carry only part of a multi-byte UTF-8 character (byte-level BPE splits CJK and
  emoji across tokens), so decoding it alone yields U+FFFD that a later token would have fixed;
* decoders are context-sensitive at the start of a sequence (SentencePiece's Metaspace decoder
  drops the leading "▁" of the first token), so a token decoded alone loses its leading space;
* a stop string can straddle deltas, so text that might begin one must be held back.
"""
from __future__ import annotations

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as context for the first output tokens: enough for the decoder to treat
# the first generated token as "not the start of the text" and to cover a multi-byte character.
_PROMPT_CONTEXT = 5
# Tokens that may be held back (text ending in U+FFFD) before we treat them as invalid bytes
# rather than a split character. A UTF-8 character has at most 4 bytes and a token carrying
# bytes has at least one, so a genuinely split character resolves within 4 such tokens.
_MAX_PENDING = 6


class IncrementalDetokenizer:
    """Turns output token ids into text deltas with O(window) work per call.

    Classic prefix/read-offset scheme: text for tokens before ``_read`` has been emitted;
    ``_prefix <= _read`` starts the decode window. Each call decodes ``ids[_prefix:]`` and
    ``ids[_prefix:_read]`` and emits the difference. The window begins at the previous emission
    so the decoder sees real context (leading spaces come out right) without re-decoding the
    whole output. Text ending in U+FFFD is held back: the next token may complete the character.

    Without ``prompt_token_ids`` the joined deltas plus ``finish()`` equal
    ``tokenizer.decode(output_ids, skip_special_tokens=...)``. With them, the output is decoded
    as a continuation of the prompt: identical for byte-level BPE, but a SentencePiece tokenizer
    keeps the leading space of the first generated word (which decoding the output alone drops).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int] | None = None,
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        seed = list(prompt_token_ids[-_PROMPT_CONTEXT:]) if prompt_token_ids else []
        # The window's emitted part must end on a character boundary for the "difference"
        # to be a suffix; drop prompt tokens that end mid-character (the output then starts
        # with the rest of that character, as decoding the output alone would show).
        while seed and self._decode(seed).endswith(_REPLACEMENT):
            seed.pop()
        self._ids: list[int] = seed
        self._prefix = 0
        self._read = len(seed)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_ids: list[int]) -> str:
        """Append generated ids; return the text that became final because of them."""
        self._ids.extend(token_ids)
        end = len(self._ids)
        if end == self._read:
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:end])
        if text.endswith(_REPLACEMENT):
            # Probably a split character: emit up to the latest boundary that ends cleanly and
            # hold the rest. After _MAX_PENDING tokens it is invalid bytes, not a split, and
            # waiting would grow the window forever; then also accept a boundary that already
            # ends in U+FFFD if decoding either side of it separately gives the same text (it
            # sits between two complete UTF-8 units, and more text follows it, so it is final).
            # Only recent boundaries are tried: earlier calls tried the older ones.
            stuck = end - self._read > _MAX_PENDING
            for cut in range(end - 1, max(self._read, end - 1 - _MAX_PENDING), -1):
                head = self._decode(self._ids[self._prefix:cut])
                if not head.endswith(_REPLACEMENT) or (
                        stuck and len(head) < len(text)
                        and head + self._decode(self._ids[cut:end]) == text):
                    return self._advance(prefix_text, head, cut)
            return ""
        return self._advance(prefix_text, text, end)

    def _advance(self, prefix_text: str, text: str, end: int) -> str:
        delta = text[len(prefix_text):]
        if delta:
            # Next window starts at the tokens that produced this delta: real context.
            self._prefix = self._read
        # With no new text (e.g. skipped special tokens) the window keeps its start, so the
        # decoder still sees visible context before the next token.
        self._read = end
        return delta

    def finish(self) -> str:
        """Flush text held back at the end of the stream (a character that never completed)."""
        end = len(self._ids)
        if end == self._read:
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        return self._advance(prefix_text, self._decode(self._ids[self._prefix:end]), end)


class StopMatcher:
    """Cuts a delta stream at the earliest stop string, holding back possible stop prefixes.

    Semantics match running ``min(text.find(s))`` over the whole text at the end: the emitted
    text is everything before the earliest occurrence of any stop string, excluding the stop
    string itself (as OpenAI and vLLM do). Among stops starting at the same place the shortest
    wins (it completes first; the emitted text is the same either way). A match is only declared
    once no other stop string could still begin earlier, so chunking never changes the result.
    """

    def __init__(self, stop: list[str]):
        self._stops = [s for s in stop if s]
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._buf = ""
        self.matched: str | None = None

    def _first_match(self) -> tuple[int, str] | None:
        best = None
        for s in self._stops:
            i = self._buf.find(s)
            if i >= 0 and (best is None or (i, len(s)) < (best[0], len(best[1]))):
                best = (i, s)
        return best

    def _first_partial(self, before: int) -> int:
        """Earliest index < ``before`` where the buffer's tail is a proper prefix of a stop."""
        start = max(0, len(self._buf) - self._max_len + 1)
        for j in range(start, before):
            tail = self._buf[j:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self._stops):
                return j
        return before

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Add a delta; return (text safe to emit now, matched stop string or None)."""
        if self.matched is not None:
            return "", self.matched
        if not self._stops:
            return delta, None
        self._buf += delta
        match = self._first_match()
        limit = match[0] if match else len(self._buf)
        safe = self._first_partial(limit)
        if match and safe == limit:
            # Nothing earlier can still turn into a stop string: the match is final.
            self.matched = match[1]
            out, self._buf = self._buf[:match[0]], ""
            return out, self.matched
        out, self._buf = self._buf[:safe], self._buf[safe:]
        return out, None

    def flush(self) -> str:
        """End of stream: held text can no longer grow into a stop string, so release it.

        A match that was waiting on a longer, earlier candidate is resolved here; check
        ``matched`` afterwards.
        """
        if self.matched is not None:
            return ""
        match = self._first_match()
        out = self._buf[:match[0]] if match else self._buf
        if match:
            self.matched = match[1]
        self._buf = ""
        return out


class TextStream:
    """What a client's stream shows of the output tokens: text deltas, cut at the first stop string."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str]):
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stops = StopMatcher(stop)

    @property
    def matched(self) -> str | None:
        return self._stops.matched

    def feed(self, token_ids: list[int]) -> tuple[str, str | None]:
        """(text safe to show now, the stop string matched or None)."""
        return self._stops.feed(self._detok.add(token_ids))

    def finish(self) -> str:
        """The text held back, once the output ended (a stop string may still match here)."""
        if self._stops.matched is not None:
            return ""
        return self._stops.feed(self._detok.finish())[0] + self._stops.flush()
