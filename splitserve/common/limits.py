"""How much one request may carry (``RequestLimits``, checked before any work starts), and how much
of its output the gateway keeps for a client that does not read it (``OutputLimits``, enforced by
``splitserve/gateway/backpressure.py``).

A gRPC message may be as large as ``--max-message-mb`` (16 MiB), and inside it a client can put
far more than any request needs: a 12 MB text prompt that the tokenizer would turn into
gigabytes of memory before its token count could be refused, millions of stop token ids that
every decode step would scan. Each field that can grow has a limit here; the gateway refuses a
request over any of them with INVALID_ARGUMENT (``splitserve.wire.check_sizes``) before
it tokenizes, admits or reserves anything.

Every field of both is a gateway flag (``--max-prompt-bytes``...; ``splitserve/cli/flags.py`` derives
them from these dataclasses, with the comments as help). A field left at 0 is derived from the served
model by ``resolve``:

* ``max_prompt_bytes``: ``max_model_len`` times the longest token of the tokenizer's vocabulary
  in bytes (``longest_token_bytes``; SmolLM2: 8192 x 81 bytes). Every byte of a text belongs to some token, and no token stands for more bytes
  than its vocabulary entry is long (byte-level BPE writes one character per byte, SentencePiece
  writes a space as the 3-byte "▁", byte fallback as "<0x41>"), so no longer text can fit in
  ``max_model_len`` tokens: the bound refuses nothing that could be served. (A tokenizer whose
  normalizer deletes characters could, in theory, fit a longer text; set the flag then.) vLLM
  guards the same way by truncating the encoding at ``max_model_len + 1`` tokens, but a fast
  tokenizer still pre-tokenizes the whole text first, which is the cost this bound avoids.
* ``max_messages``: ``max_model_len`` -- every chat template spends at least one token on a
  turn, so more turns cannot fit.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tokenizers import decoders

__all__ = ["RequestLimits", "OutputLimits", "longest_token_bytes"]

# A token stands for at least one character, which may take 4 bytes in UTF-8: the floor of the
# derived bytes-per-token figure, whatever a (tiny, test) vocabulary says.
MIN_BYTES_PER_TOKEN = 4


@dataclass(frozen=True)
class RequestLimits:
    # longest prompt given as text, or as chat messages (their roles and contents together), in
    # UTF-8 bytes, refused before it is tokenized; 0: max_model_len times the longest token of
    # the model's vocabulary in bytes (no longer text fits max_model_len tokens)
    max_prompt_bytes: int = 0
    # most chat messages in one request; 0: max_model_len (every turn of a chat template costs
    # at least one token)
    max_messages: int = 0
    # most stop strings (sampling.stop) in one request
    max_stop_sequences: int = 16
    # longest stop string, in UTF-8 bytes
    max_stop_bytes: int = 256
    # most stop token ids (sampling.stop_token_ids) in one request
    max_stop_token_ids: int = 128
    # longest request_id, in UTF-8 bytes
    max_request_id_bytes: int = 256
    # largest structured-output spec (a JSON schema, a regex, or a choice's strings together), in
    # UTF-8 bytes: each distinct one is compiled on the gateway's checker and on every worker
    max_grammar_bytes: int = 32768
    # deepest nesting of a JSON schema's objects and arrays (each level of "properties" or
    # "items" takes two); a few hundred levels compile for minutes
    max_schema_depth: int = 48

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            derived = f.default == 0
            if not isinstance(value, int) or value < (0 if derived else 1):
                least = "0 (derive it from the model)" if derived else "1"
                raise ValueError(f"{f.name} must be an integer >= {least}, got {value!r}")

    def resolve(self, max_model_len: int, tokenizer) -> "RequestLimits":
        """These limits with every 0 replaced by its value for this model (see the module doc)."""
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        per_token = max(MIN_BYTES_PER_TOKEN, longest_token_bytes(tokenizer)) if not self.max_prompt_bytes else 0
        return dataclasses.replace(self, max_prompt_bytes=self.max_prompt_bytes or max_model_len * per_token,
                                   max_messages=self.max_messages or max_model_len)

    @classmethod
    def from_args(cls, args) -> "RequestLimits":
        """The limits given on a gateway's command line (its flags carry the field names)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class OutputLimits:
    """Bounds on generated output that waits at the gateway for its client (see
    ``splitserve/gateway/backpressure.py``)."""

    # generated tokens that may wait at the gateway for one client that is not taking them (its
    # HTTP/2 window is full); past it the request ends with RESOURCE_EXHAUSTED
    max_buffered_tokens_per_stream: int = 4096
    # bytes of generated output (ids, text, logprobs) waiting at the gateway for all its clients
    # together; past it new Generate calls get RESOURCE_EXHAUSTED with a retry hint
    max_buffered_bytes: int = 64 * 2**20
    # seconds a streamed message may wait for its client to take it; then the request ends with
    # RESOURCE_EXHAUSTED
    slow_reader_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{f.name} must be > 0, got {value!r}")

    @classmethod
    def from_args(cls, args) -> "OutputLimits":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def longest_token_bytes(tokenizer) -> int:
    """At least as many bytes as any one token of ``tokenizer`` stands for in a text: the longest
    vocabulary entry (added and special tokens included) in UTF-8 bytes. A byte-level BPE writes
    each byte as one character, some of them 2 bytes long in UTF-8 ("Ġ" for a space), so there
    its model entries count in characters, which halves the bound (SmolLM2: 81, not 162)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and isinstance(backend.decoder, decoders.ByteLevel):
        model_entries = max(map(len, backend.get_vocab(with_added_tokens=False)), default=0)
        added = max((len(token.encode("utf-8")) for token in tokenizer.get_added_vocab()), default=0)
        return max(model_entries, added)
    return max(len(token.encode("utf-8")) for token in tokenizer.get_vocab())
