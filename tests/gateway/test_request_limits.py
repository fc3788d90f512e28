"""splitserve.common.limits: the gateway's request size limits, and the prompt-bytes bound they derive."""
from __future__ import annotations

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from splitserve.common.limits import MIN_BYTES_PER_TOKEN, RequestLimits, longest_token_bytes
from tests.harness.tiny_models import byte_tokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "          indented code", "=" * 64,
          "Übergrößenträger façade naïve", "日本語のテキストです", "emoji 🙂🙃 and more emoji 🙂🙃"] * 20


@pytest.fixture(scope="module")
def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with real merges (long tokens: runs of spaces and '='), as GPT-2 and Llama 3 have."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def test_defaults_and_validation():
    limits = RequestLimits()
    assert (limits.max_stop_sequences, limits.max_stop_bytes, limits.max_stop_token_ids,
            limits.max_request_id_bytes) == (16, 256, 128, 256)
    assert (limits.max_prompt_bytes, limits.max_messages) == (0, 0)  # derived from the model
    with pytest.raises(ValueError, match="max_stop_sequences must be an integer >= 1, got 0"):
        RequestLimits(max_stop_sequences=0)
    with pytest.raises(ValueError, match=r"max_prompt_bytes must be an integer >= 0 \(derive"):
        RequestLimits(max_prompt_bytes=-1)


def test_resolve_derives_the_zeros_from_the_model_and_keeps_the_rest():
    tok = byte_tokenizer()  # one byte per token; its longest entry is "<bos>" (5 bytes)
    assert longest_token_bytes(tok) == 5
    limits = RequestLimits(max_stop_sequences=3).resolve(1024, tok)
    assert (limits.max_prompt_bytes, limits.max_messages, limits.max_stop_sequences) == (1024 * 5, 1024, 3)
    given_ = RequestLimits(max_prompt_bytes=77, max_messages=5).resolve(1024, tok)
    assert (given_.max_prompt_bytes, given_.max_messages) == (77, 5)
    assert RequestLimits.from_args(argparse.Namespace(
        max_prompt_bytes=1, max_messages=2, max_stop_sequences=3, max_stop_bytes=4, max_stop_token_ids=5,
        max_request_id_bytes=6, max_grammar_bytes=7, max_schema_depth=8, unrelated="x")) == RequestLimits(1, 2, 3, 4, 5, 6, 7, 8)


def test_the_floor_is_one_utf8_character_per_token():
    class Tiny:
        def get_vocab(self):
            return {"a": 0, "b": 1}
    assert RequestLimits().resolve(10, Tiny()).max_prompt_bytes == 10 * MIN_BYTES_PER_TOKEN


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=st.text(st.sampled_from(list(" =abcdefghijklmnopqrstuvwxyzÜößçï日本語🙂\n\t")) | st.characters(
    exclude_categories=("Cs",)), max_size=300))
def test_no_text_longer_than_the_bound_fits_its_token_count(bpe_tokenizer, text):
    # The derived bound is tokens x longest entry: it must never refuse a text that fits, i.e.
    # every text's bytes are at most its token count times the longest entry's bytes.
    longest = longest_token_bytes(bpe_tokenizer)
    assert longest >= 16  # the merges made long tokens (runs of '=' and spaces)
    n_tokens = len(bpe_tokenizer.encode(text))
    assert len(text.encode("utf-8")) <= n_tokens * max(MIN_BYTES_PER_TOKEN, longest)
