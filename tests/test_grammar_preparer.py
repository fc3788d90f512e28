"""A worker compiles each request's grammar beside its engine thread, once per spec, within a time
limit (issue 36, point 1): ``splitserve.worker.grammars.GrammarPreparer`` over the engine's real
``GrammarCompiler`` and SmolLM2's real 49k-token vocabulary.

``[^x]{1,N}`` is the slow grammar: xgrammar parses it in well under a millisecond (so the
gateway's check lets it through) and compiles it against the vocabulary in about 1.5-2 s here.
"""
import asyncio
import threading

import pytest

from splitserve.common.errors import InvalidArgument
from splitserve.engine.grammar import GrammarCompiler
from splitserve.engine.model_loader import DEFAULT_MODEL, load_tokenizer, resolve_model
from splitserve.engine.structured_output import StructuredOutput
from splitserve.worker.grammars import GrammarPreparer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(DEFAULT_MODEL))


class ThreadRecorder:
    """The real compiler, and on which threads it compiled (a spy, not a stand-in)."""

    def __init__(self, tokenizer):
        self.compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
        self.threads: list[str] = []
        real = self.compiler.compile

        def compile(spec, count=True):
            self.threads.append(threading.current_thread().name)
            return real(spec, count)
        self.compiler.compile = compile


def test_compiles_off_the_callers_thread_once_per_spec_and_the_engine_thread_finds_it(tokenizer):
    recorder = ThreadRecorder(tokenizer)
    preparer = GrammarPreparer(recorder.compiler, timeout_s=60)
    spec = StructuredOutput(regex="[^x]{1,2500}")
    beats = []

    async def heartbeat():  # the event loop the worker's streams run on
        while True:
            beats.append(asyncio.get_running_loop().time())
            await asyncio.sleep(0.01)

    async def main():
        beat = asyncio.ensure_future(heartbeat())
        try:
            # Four requests bring the same new spec at once: one compile, which all of them wait for.
            await asyncio.gather(*(preparer.prepare(spec) for _ in range(4)))
        finally:
            beat.cancel()
    try:
        asyncio.run(main())
    finally:
        preparer.close()
    assert recorder.compiler.misses == 1 and recorder.compiler.hits == 0
    assert recorder.threads == ["grammar-compile_0"]
    gaps = [b - a for a, b in zip(beats, beats[1:])]
    assert len(beats) > 20 and max(gaps) < 0.5, "the event loop stood still while the grammar compiled"
    # The engine thread's lookup is a hit, and not counted a second time.
    grammar = recorder.compiler.grammar(spec)
    assert grammar.ok and recorder.threads[-1] == threading.current_thread().name
    assert recorder.compiler.misses == 1 and recorder.compiler.hits == 0


def test_a_spec_past_the_time_limit_is_refused_and_its_compile_still_kept(tokenizer):
    recorder = ThreadRecorder(tokenizer)
    preparer = GrammarPreparer(recorder.compiler, timeout_s=0.05)
    spec = StructuredOutput(regex="[^x]{1,2600}")

    async def main():  # one event loop, as in a worker
        with pytest.raises(InvalidArgument) as refused:
            await preparer.prepare(spec)
        assert "sampling.structured_output.regex" in str(refused.value)
        assert "--grammar-compile-timeout-s" in str(refused.value)
        # The thread cannot be stopped: its compile ends and is cached, so a retry is quick.
        # Wait for the preparer to see it end too: the thread caches the grammar before its
        # future's completion reaches this loop, and a retry in between joins that finished
        # compile (quick as well, but not a cache hit: the count below would be 0).
        for _ in range(1200):
            if spec.key in recorder.compiler._cache and spec.key not in preparer._compiling:
                break
            await asyncio.sleep(0.1)
        assert spec.key in recorder.compiler._cache
        await preparer.prepare(spec)
    try:
        asyncio.run(main())
    finally:
        preparer.close()
    assert recorder.compiler.misses == 1 and recorder.compiler.hits == 1


def test_a_spec_that_does_not_compile_is_invalid_argument_naming_the_field(tokenizer):
    preparer = GrammarPreparer(GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]), timeout_s=10)
    try:
        with pytest.raises(InvalidArgument, match=r"^sampling\.structured_output\.regex"):
            asyncio.run(preparer.prepare(StructuredOutput(regex="[a-")))
        asyncio.run(preparer.prepare(None))  # no constraint: nothing to do
    finally:
        preparer.close()
