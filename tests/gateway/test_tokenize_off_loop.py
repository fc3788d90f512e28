"""The gateway encodes large text prompts beside its event loop, a few at a time (issue 36, point 3),
and small ones on it (issue 41: the trip to a thread cost more than the encoding).

A unit test of ``PromptEncoder`` alone: its tokenizer is a stand-in whose encode
waits for the test, as a 650 KB prompt keeps a real one busy for 0.3 s. While it waits, the event
loop goes on (another request's token ids come through); past MAX_TOKENIZE_WAITING prompts, one
more is refused at once. Those tests send prompts past INLINE_ENCODE_BYTES (the ``big`` fixture
lowers it, so their prompts stay short).
"""
import asyncio
import threading

import pytest

from splitserve.common.errors import ResourceExhausted
from splitserve.gateway import prompt_encoder as encoder_module
from splitserve.gateway.prompt_encoder import PromptEncoder
from splitserve.v1 import generation_pb2


class HeldTokenizer:
    """Encodes one id per character, once the test lets it; says on which thread it ran."""

    def __init__(self):
        self.go = threading.Event()
        self.threads: list[str] = []

    def encode(self, text, add_special_tokens=True):
        self.threads.append(threading.current_thread().name)
        assert self.go.wait(30)
        return [ord(c) % 100 for c in text]


def encoder(tokenizer) -> PromptEncoder:
    return PromptEncoder(tokenizer, vocab_size=100)


def request(**prompt) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(**prompt)


@pytest.fixture
def big(monkeypatch):
    """Every text prompt counts as large (past INLINE_ENCODE_BYTES): it goes to the threads."""
    monkeypatch.setattr(encoder_module, "INLINE_ENCODE_BYTES", 0)


def test_a_long_encode_does_not_hold_the_event_loop(big):
    tokenizer = HeldTokenizer()
    gateway = encoder(tokenizer)

    async def main():
        held = asyncio.ensure_future(gateway.token_ids(request(text="abc")))
        while not tokenizer.threads:  # it is encoding now, on a thread of its own...
            await asyncio.sleep(0.01)
        # ... and the loop serves another request meanwhile.
        assert await gateway.token_ids(request(token_ids=[1, 2, 3])) == [1, 2, 3]
        assert not held.done()
        tokenizer.go.set()
        return await held

    assert asyncio.run(main()) == [97, 98, 99]
    assert tokenizer.threads[0].startswith("tokenize") and tokenizer.threads[0] != threading.current_thread().name


def test_prompts_past_the_waiting_bound_are_refused_at_once(monkeypatch, big):
    monkeypatch.setattr(encoder_module, "MAX_TOKENIZE_WAITING", 3)
    tokenizer = HeldTokenizer()
    gateway = encoder(tokenizer)

    async def main():
        waiting = [asyncio.ensure_future(gateway.token_ids(request(text=f"p{i}"))) for i in range(3)]
        await asyncio.sleep(0.05)
        with pytest.raises(ResourceExhausted, match="waiting to be tokenized"):
            await gateway.token_ids(request(text="one more"))
        assert await gateway.token_ids(request(token_ids=[4])) == [4]  # ids need no encoder
        tokenizer.go.set()
        return await asyncio.gather(*waiting)

    assert len(asyncio.run(main())) == 3
    assert gateway.waiting == 0
    # Two at a time: no more encoder threads than TOKENIZE_THREADS.
    assert len(set(tokenizer.threads)) <= encoder_module.TOKENIZE_THREADS


def test_small_requests_are_encoded_on_the_event_loop_and_large_ones_beside_it():
    tokenizer = HeldTokenizer()
    tokenizer.go.set()
    gateway = encoder(tokenizer)
    small = request(text="a" * 1000)
    large = request(text="b" * (encoder_module.INLINE_ENCODE_BYTES + 1))
    assert small.ByteSize() <= encoder_module.INLINE_ENCODE_BYTES < large.ByteSize()

    async def main():
        loop_thread = threading.current_thread().name
        assert await gateway.token_ids(small) == [97 % 100] * 1000
        assert await gateway.token_ids(large) == [98 % 100] * len(large.text)
        return loop_thread

    loop_thread = asyncio.run(main())
    assert tokenizer.threads[0] == loop_thread
    assert tokenizer.threads[1].startswith("tokenize")
    assert gateway.waiting == 0
