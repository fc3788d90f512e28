"""The gateway encodes text prompts beside its event loop, a few at a time (issue 36, point 3).

A unit test of ``GenerationServicer._tokenize`` alone: its tokenizer is a stand-in whose encode
waits for the test, as a 650 KB prompt keeps a real one busy for 0.3 s. While it waits, the event
loop goes on (another request's token ids come through); past MAX_TOKENIZE_WAITING prompts, one
more is refused at once.
"""
import asyncio
import threading
import types

import pytest

from splitserve.common.errors import ResourceExhausted
from splitserve.common.limits import RequestLimits
from splitserve.gateway import servicer as servicer_module
from splitserve.gateway.servicer import GenerationServicer
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


def servicer(tokenizer) -> GenerationServicer:
    info = generation_pb2.ModelInfo(max_model_len=4096, vocab_size=100)
    return GenerationServicer(state=None, dispatcher=types.SimpleNamespace(ledger=None), tokenizer=tokenizer,
                              model_info=info, limits=RequestLimits(), grammars=object())


def request(**prompt) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(**prompt)


def test_a_long_encode_does_not_hold_the_event_loop():
    tokenizer = HeldTokenizer()
    gateway = servicer(tokenizer)

    async def main():
        held = asyncio.ensure_future(gateway._tokenize(request(text="abc")))
        while not tokenizer.threads:  # it is encoding now, on a thread of its own...
            await asyncio.sleep(0.01)
        # ... and the loop serves another request meanwhile.
        assert await gateway._tokenize(request(token_ids=[1, 2, 3])) == [1, 2, 3]
        assert not held.done()
        tokenizer.go.set()
        return await held

    assert asyncio.run(main()) == [97, 98, 99]
    assert tokenizer.threads[0].startswith("tokenize") and tokenizer.threads[0] != threading.current_thread().name


def test_prompts_past_the_waiting_bound_are_refused_at_once(monkeypatch):
    monkeypatch.setattr(servicer_module, "MAX_TOKENIZE_WAITING", 3)
    tokenizer = HeldTokenizer()
    gateway = servicer(tokenizer)

    async def main():
        waiting = [asyncio.ensure_future(gateway._tokenize(request(text=f"p{i}"))) for i in range(3)]
        await asyncio.sleep(0.05)
        with pytest.raises(ResourceExhausted, match="waiting to be tokenized"):
            await gateway._tokenize(request(text="one more"))
        assert await gateway._tokenize(request(token_ids=[4])) == [4]  # ids need no encoder
        tokenizer.go.set()
        return await asyncio.gather(*waiting)

    assert len(asyncio.run(main())) == 3
    assert gateway._waiting_to_encode == 0
    # Two at a time: no more encoder threads than TOKENIZE_THREADS.
    assert len(set(tokenizer.threads)) <= servicer_module.TOKENIZE_THREADS
