"""The grammar library's side of structured output (xgrammar; ``structured_output.StructuredOutput``
is the spec it compiles).

xgrammar was measured against llguidance on SmolLM2's 49152-token vocabulary
(``bench/structured_output.py``): filling a token bitmask costs ~20 us per token with xgrammar
against ~250-450 us with llguidance.

* ``check_grammar`` -- compiles a spec without a tokenizer, so that an invalid schema or regex
  is refused with a message naming the field before anything is queued (the gateway runs it in
  a child process: ``python -m splitserve.engine.grammar_server``);
* ``GrammarCompiler`` (one per engine: the tokenizer's token table is built once, compiled
  grammars are cached by spec) and ``Grammar`` (one per request: the matcher that says which
  tokens may come next and advances with every accepted token).

``apply_grammar_bitmask`` is what the sampler calls: it fills one bitmask row per constrained
sequence on the CPU and applies it to the logits where they lie (CPU or CUDA), leaving the
unconstrained rows of the batch untouched.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence

from splitserve.engine.structured_output import StructuredOutput

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


# Compact JSON only: with free whitespace allowed, a small model can emit newlines or spaces
# until max_tokens and never close the object (xgrammar's ``any_whitespace``). Separators are
# those of ``json.dumps``: ", " and ": ".
_ANY_WHITESPACE = False
# Any JSON object, for ``response_format: {"type": "json_object"}`` (OpenAI asks for an object,
# not any JSON value).
_OBJECT_SCHEMA = '{"type": "object"}'


def _choice_ebnf(choice: Sequence[str]) -> str:
    # json.dumps writes each choice as a quoted string with \", \\, \n and \uXXXX escapes,
    # which is also how xgrammar's EBNF writes string literals.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


def _grammar(spec: StructuredOutput):
    """The tokenizer-free grammar of ``spec`` (raises on an invalid schema / regex)."""
    import xgrammar as xgr

    kind = spec.kind
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(spec.json_schema, any_whitespace=_ANY_WHITESPACE)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema(_OBJECT_SCHEMA, any_whitespace=_ANY_WHITESPACE)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec.regex)
    return xgr.Grammar.from_ebnf(_choice_ebnf(spec.choice))


def _library_message(error: Exception) -> str:
    # xgrammar prefixes its C++ source location ("[12:00:00] /project/cpp/x.cc:94: "); keep the rest.
    text = str(error).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if text.startswith("Check failed") and ": " in text:
            text = text.split(": ", 1)[1].removeprefix("is false: ")
    return text


def check_grammar(spec: StructuredOutput) -> None:
    """Raise ValueError naming the field if the grammar library refuses ``spec`` (an unsupported
    schema keyword or type, a regex that does not parse). Cheap: no tokenizer is involved."""
    try:
        _grammar(spec)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"structured_output.{spec.kind} is not supported: {_library_message(e)}") from None


class Grammar:
    """One request's matcher: which tokens may come next, advanced by every accepted token."""

    def __init__(self, matcher, after: Sequence[int] = (), opener: int | None = None):
        """``after``: tokens the output writes before the constraint starts (the end of a
        reasoning model's thinking); until then every token is allowed. ``opener``: only an
        output that starts with this token waits for them (the model may also answer at once:
        its first token may be the opener or one the grammar allows)."""
        self._matcher = matcher
        self._after = tuple(after)
        self._opener = opener if self._after else None  # still undecided: the first token decides
        self._tail: tuple[int, ...] = ()  # the last len(after) tokens, while waiting for them
        # False once a token the grammar refuses got through (nothing should let one through;
        # the request then ends rather than decoding on from a state the grammar cannot follow).
        self.ok = True

    @property
    def active(self) -> bool:
        """The constraint applies to the next token (it is not waiting for ``after``)."""
        return not self._after or self._opener is not None

    def accept(self, token_id: int) -> bool:
        if self._opener is not None:  # the first token: the opener (wait for the end) or the answer's
            opener, self._opener = self._opener, None
            if token_id == opener:
                return True
            self._after = ()
        if self._after:
            self._tail = (self._tail + (token_id,))[-len(self._after):]
            if self._tail == self._after:
                self._after = ()
            return True
        if self.ok and not self._matcher.is_terminated():
            self.ok = bool(self._matcher.accept_token(token_id))
            if not self.ok:
                log.warning("structured output: the grammar refused token %d; ending the request", token_id)
        return self.ok

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: nothing may follow."""
        return self.active and self._opener is None and self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._opener is not None:  # also allowed first: the opener of the reasoning
            word, bit = divmod(self._opener, 32)
            value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)  # int32 words, bit 31 the sign
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


class GrammarCompiler:
    """Per engine: the tokenizer's token table (built on the first constrained request, ~0.4 s
    for a 49k vocabulary) and the compiled grammars, kept by spec up to ``cache_bytes`` (least
    recently used out first): clients that send a new schema each time must not grow the worker
    without bound. ``hits``/``misses``/``cached_bytes`` say how it does.

    ``compile`` is thread-safe: a worker compiles each request's spec on a thread of its own
    (``splitserve.worker.grammars``) before the request reaches the engine thread, whose
    ``grammar`` then finds it cached. Such a worker sets ``counted_on_engine_thread`` False: a
    request is then counted once, where it was compiled, not again on the engine thread."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], cache_bytes: int = 256 << 20):
        # vocab_size is the logits' width (the model's), which may exceed the tokenizer's.
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[tuple, object] = OrderedDict()  # spec key -> compiled grammar, oldest first
        self._lock = threading.Lock()  # the cache and the token table; never held while compiling
        self.cached_bytes = 0
        self.hits = 0
        self.misses = 0
        self.counted_on_engine_thread = True

    def _xgrammar_compiler(self):
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # cached below, by spec
            return self._compiler

    def _cached(self, key: tuple, count: bool):
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            if count:
                if compiled is not None:
                    self.hits += 1
                else:
                    self.misses += 1
            return compiled

    def _keep(self, key: tuple, compiled) -> None:
        with self._lock:
            if key in self._cache:  # compiled twice at once (two threads): keep one
                return
            self._cache[key] = compiled
            self.cached_bytes += compiled.memory_size_bytes
            while self.cached_bytes > self.cache_bytes and len(self._cache) > 1:  # (the newest stays: in use)
                _, evicted = self._cache.popitem(last=False)
                self.cached_bytes -= evicted.memory_size_bytes

    def compile(self, spec: StructuredOutput, count: bool = True):
        """The compiled grammar of ``spec``, from the cache or compiled now (any thread; the GIL
        is mostly released while xgrammar compiles). Raises ValueError naming the field if the
        spec does not compile."""
        compiled = self._cached(spec.key, count)
        if compiled is not None:
            return compiled
        compiler = self._xgrammar_compiler()
        try:
            compiled = compiler.compile_grammar(_grammar(spec))
        except RuntimeError as e:
            raise ValueError(f"structured_output.{spec.kind} is not supported: {_library_message(e)}") from None
        self._keep(spec.key, compiled)
        return compiled

    def grammar(self, spec: StructuredOutput, generated: Sequence[int] = ()) -> Grammar:
        """A fresh matcher for ``spec`` that has already accepted ``generated`` (tokens produced
        under the constraint before: a retried request's, a handed-over request's first token).
        Raises ValueError if the spec does not compile or the tokens do not fit it."""
        import xgrammar as xgr

        grammar = Grammar(xgr.GrammarMatcher(self.compile(spec, count=self.counted_on_engine_thread)),
                          spec.after_token_ids, spec.after_opener)
        for token in generated:
            if not grammar.accept(token):
                raise ValueError(f"structured_output: token {token} of the resumed output does not fit the "
                                 f"{spec.kind} constraint")
        return grammar


def apply_grammar_bitmask(logits: "torch.Tensor", grammars: Sequence[Grammar | None]) -> None:
    """In place: for every row whose grammar is set, forbid (-inf) the tokens it does not allow
    next. The bitmask is filled on the CPU (the matchers live there) and applied where the
    logits are, by xgrammar's kernel (a CUDA/Triton one on a GPU)."""
    import xgrammar as xgr

    rows = [i for i, g in enumerate(grammars) if g is not None and g.active and not g.is_terminated]
    if not rows:
        return
    vocab = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab)
    for i in rows:
        grammars[i].fill_bitmask(bitmask, i)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
