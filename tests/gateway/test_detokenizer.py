"""Streaming detokenizer and stop-string matcher: deltas must add up to the one-shot result."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from splitserve.gateway.detokenizer import IncrementalDetokenizer, StopMatcher
from tests.harness.tiny_models import VOCAB_SIZE, byte_tokenizer

SMOLLM2 = Path(os.path.expanduser("~/.cache/splitserve/models/smollm2-135m-instruct"))
FFFD = "\ufffd"
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

BYTE_TOK = byte_tokenizer()
_smol = None


def smollm2():
    global _smol
    if _smol is None:
        if not SMOLLM2.exists():
            pytest.skip("SmolLM2 tokenizer not downloaded")
        _smol = AutoTokenizer.from_pretrained(str(SMOLLM2))
    return _smol


def stream(tok, ids, chunks, prompt=None, skip=True):
    """Feed ``ids`` in the given chunk sizes; return (deltas from add(), text from finish())."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas, i, sizes = [], 0, iter(chunks)
    while i < len(ids):
        n = max(1, next(sizes, 1))
        deltas.append(detok.add(ids[i:i + n]))
        i += n
    return deltas, detok.finish()


def check_stream(tok, ids, chunks, prompt, skip):
    deltas, tail = stream(tok, ids, chunks, prompt, skip)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)


# ---------------------------------------------------------------- IncrementalDetokenizer

@SETTINGS
@given(ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=60),
       prompt=st.none() | st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=8),
       chunks=st.lists(st.integers(1, 4), max_size=60), skip=st.booleans())
def test_byte_tokenizer_random_ids(ids, prompt, chunks, skip):
    check_stream(BYTE_TOK, ids, chunks, prompt, skip)


@SETTINGS
@given(ids=st.lists(st.integers(0, 49151), max_size=40),
       prompt=st.none() | st.lists(st.integers(0, 49151), max_size=8),
       chunks=st.lists(st.integers(1, 3), max_size=40), skip=st.booleans())
def test_smollm2_random_ids(ids, prompt, chunks, skip):
    check_stream(smollm2(), ids, chunks, prompt, skip)


@SETTINGS
@given(ids=st.lists(st.sampled_from(range(0, 17)) | st.integers(17, 49151), max_size=30),
       skip=st.booleans())
def test_smollm2_special_tokens_mixed_in(ids, skip):
    # Specials (0..16) are drawn far more often here than in the uniform test above.
    check_stream(smollm2(), ids, [1] * len(ids), None, skip)


@SETTINGS
@given(text=st.text(max_size=40), prompt=st.text(max_size=10))
def test_real_text_one_token_at_a_time(text, prompt):
    """Valid UTF-8 text: no U+FFFD anywhere in the stream, exact final text."""
    for tok in (BYTE_TOK, smollm2()):
        ids = tok.encode(text, add_special_tokens=False)
        p = tok.encode(prompt, add_special_tokens=False) or None
        deltas, tail = stream(tok, ids, [1] * len(ids), p)
        expected = tok.decode(ids, skip_special_tokens=True)
        assert "".join(deltas) + tail == expected
        if FFFD not in expected:  # SmolLM2's vocab lacks a few bytes, e.g. 0xF1
            assert FFFD not in "".join(deltas) + tail


@pytest.mark.parametrize("text", ["こんにちは、世界！今日はいい天気ですね。",
                                  "emoji 😀👍🏽🇯🇵 mixed with 日本語 and text 👨‍👩‍👧",
                                  " leading space, multiple   spaces\nand newlines\t."])
def test_smollm2_multibyte_one_token_at_a_time(text):
    tok = smollm2()
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("User: say it\nAssistant:"))
    deltas = [detok.add([i]) for i in ids]
    tail = detok.finish()
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) + tail == text
    assert tail == ""  # every character completed before the end
    if not text.isascii():
        # The test is only meaningful if some tokens really split a character.
        assert any(FFFD in tok.decode([i]) for i in ids)


def test_window_stays_small():
    """Work per step is bounded: decode is only ever called on a few recent tokens."""
    tok = smollm2()
    sizes = []

    class Spy:
        def decode(self, ids, **kw):
            sizes.append(len(ids))
            return tok.decode(ids, **kw)

    text = "日本語のテキストと emoji 😀 を含む長い文章です。" * 40
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(Spy(), ids[:3])
    out = "".join(detok.add([i]) for i in ids) + detok.finish()
    assert out == text and len(ids) > 500
    assert max(sizes) <= 10


def test_invalid_bytes_do_not_grow_window():
    """A stream of lone UTF-8 lead bytes never completes a character; the window stays bounded."""
    sizes = []

    class Spy:
        def decode(self, ids, **kw):
            sizes.append(len(ids))
            return BYTE_TOK.decode(ids, **kw)

    lead = BYTE_TOK.convert_tokens_to_ids("Ã")  # the byte 0xC3, a 2-byte lead
    ids = [lead] * 300
    detok = IncrementalDetokenizer(Spy())
    deltas = [detok.add([i]) for i in ids]
    assert "".join(deltas) + detok.finish() == BYTE_TOK.decode(ids)
    assert max(sizes) <= 20


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece-style decoding: the first token's leading '▁' is dropped."""
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "!": 3, "▁hi": 4, "<eos>": 5}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def test_sentencepiece_leading_spaces():
    tok = metaspace_tokenizer()
    ids = [1, 2, 3, 2, 5]
    assert tok.decode([2]) == "world"  # why per-token decoding is wrong
    assert "".join(tok.decode([i], skip_special_tokens=True) for i in ids) == "helloworld!world"
    deltas, tail = stream(tok, ids, [1] * len(ids))
    assert deltas == ["hello", " world", "!", " world", ""]
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=True) == "hello world! world"
    # Seeded with the prompt, the first word is a continuation and keeps its space.
    deltas, tail = stream(tok, ids, [1] * len(ids), prompt=[4])
    assert "".join(deltas) + tail == " hello world! world"
    # A skipped special token in between must not cost the next word its space.
    deltas, tail = stream(tok, [1, 5, 5, 2], [1] * 4)
    assert "".join(deltas) + tail == "hello world"


def test_finish_flushes_incomplete_character():
    ids = BYTE_TOK.encode("a€", add_special_tokens=False)[:-1]  # '€' cut after 2 of 3 bytes
    detok = IncrementalDetokenizer(BYTE_TOK)
    assert detok.add(ids) == "a"
    assert detok.finish() == BYTE_TOK.decode(ids)[1:]
    assert detok.finish() == ""


# ---------------------------------------------------------------- StopMatcher

def run_matcher(stop, deltas):
    m = StopMatcher(stop)
    out = []
    for d in deltas:
        text, matched = m.feed(d)
        out.append(text)
    out.append(m.flush())
    return out, m.matched


def test_stop_inside_one_delta():
    m = StopMatcher(["STOP"])
    assert m.feed("hello STOP world") == ("hello ", "STOP")
    assert m.feed("more") == ("", "STOP")
    assert m.flush() == ""


def test_stop_spanning_deltas():
    m = StopMatcher(["\n\nUser:"])
    assert m.feed("Sure.\n") == ("Sure.", None)
    assert m.feed("\nUs") == ("", None)
    assert m.feed("er: hi") == ("", "\n\nUser:")


def test_false_start_is_released():
    m = StopMatcher(["</s>"])
    assert m.feed("a</") == ("a", None)
    assert m.feed("b>") == ("</b>", None)
    assert m.feed("c</s") == ("c", None)
    assert m.flush() == "</s"
    assert m.matched is None


def test_overlapping_prefix():
    assert run_matcher(["ab"], ["a", "a", "b", "c"]) == (["", "a", "", "", ""], "ab")
    assert run_matcher(["ab"], ["aab"]) == (["a", ""], "ab")
    assert run_matcher(["aab"], ["a", "a", "a", "b"]) == (["", "", "a", "", ""], "aab")


def test_earliest_of_several_stops_wins():
    assert run_matcher(["world", "lo"], ["hello world"]) == (["hel", ""], "lo")
    # "bc" completes first but "abcd" started earlier and may still complete: wait.
    m = StopMatcher(["bc", "abcd"])
    assert m.feed("xab") == ("x", None)
    assert m.feed("c") == ("", None)
    assert m.feed("d") == ("", "abcd")
    m = StopMatcher(["bc", "abcd"])
    m.feed("xabc")
    assert m.feed("e") == ("a", "bc")
    # Resolved at the end of the stream when the longer candidate never completed.
    m = StopMatcher(["bc", "abcd"])
    assert m.feed("abc") == ("", None)
    assert m.flush() == "a" and m.matched == "bc"


def test_no_stops_is_pass_through():
    m = StopMatcher([])
    for d in ["a", "</s", "\n\n", ""]:
        assert m.feed(d) == (d, None)
    assert m.flush() == ""


def test_no_holdback_without_possible_prefix():
    m = StopMatcher(["STOP"])
    assert m.feed("hello world") == ("hello world", None)
    assert m.feed(" S") == (" ", None)
    assert m.flush() == "S"


@settings(max_examples=400, deadline=None)
@given(text=st.text("abc", max_size=20), stop=st.lists(st.text("abc", min_size=1, max_size=4),
                                                       max_size=3),
       cuts=st.lists(st.integers(0, 20), max_size=6))
def test_matcher_agrees_with_whole_text(text, stop, cuts):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, matched = run_matcher(stop, deltas)
    hits = [(text.find(s), len(s), s) for s in stop if s in text]
    if hits:
        i, _, s = min(hits)
        assert ("".join(out), matched) == (text[:i], s)
    else:
        assert ("".join(out), matched) == (text, None)
