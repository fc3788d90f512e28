"""A worker compiles each request's structured-output grammar before the request reaches its engine.

Compiling a grammar against the tokenizer's vocabulary takes from milliseconds to seconds (a
nested schema, a long regex). On the engine thread that time would stop every request of the
batch; on the event loop, every stream of the worker. So the handlers await ``prepare``, which
compiles on threads of its own (xgrammar releases the GIL for most of the work), and the engine
thread then finds the grammar in the engine's cache (``GrammarCompiler.compile``).

* One compile per spec at a time: requests that bring the same new spec while it compiles wait
  for that one compile, not a compile each.
* A time limit: a request whose spec takes longer than ``timeout_s`` is refused
  (INVALID_ARGUMENT naming the field and ``--grammar-compile-timeout-s``). A thread cannot be
  stopped, so the compile runs on and its result is cached (a retry of the same spec is then
  quick); the gateway's own check of every spec, in a child process it kills after its time
  limit, and the size and depth limits keep such compiles rare.
* Decode workers start the compile when the pages are reserved, from the spec the gateway sends
  with ``Reserve``, so it overlaps the prefill instead of following it.

Shipping a compiled grammar from one worker to the next was measured against compiling it again
(SmolLM2's 49k vocabulary, a 200 ms regex: 5 MB in memory, 16 MB serialized, 450 ms to serialize
and 190 ms to read back), so each worker compiles, and keeps, its own.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging

from splitserve.common.errors import InvalidArgument
from splitserve.engine.structured_output import StructuredOutput
from splitserve.worker.engine_loop import lower_thread_priority

log = logging.getLogger(__name__)

# Compiles that run at once (each may use several of xgrammar's own threads).
THREADS = 2
# How much lower than the engine's the compile threads' CPU priority is (their nice value, which
# threads they start inherit): on a box with fewer cores than busy threads, the engine's steps go
# first and the compile takes what is left.
NICENESS = 5


class GrammarPreparer:
    def __init__(self, compiler, timeout_s: float, threads: int = THREADS, engine_niceness: int = 0):
        """``compiler``: the engine's ``GrammarCompiler``, whose cache the engine thread reads;
        ``engine_niceness``: the engine thread's (``EngineLoop``): the compile threads go below it."""
        self.compiler = compiler
        compiler.counted_on_engine_thread = False  # counted here, once per request
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile",
                                                           initializer=lower_thread_priority,
                                                           initargs=(engine_niceness + NICENESS,))
        self._compiling: dict[tuple, asyncio.Future] = {}  # spec key -> its compile under way

    def start(self, spec: StructuredOutput | None) -> asyncio.Future | None:
        """Start compiling ``spec`` (or join its compile under way); None without a spec."""
        if spec is None:
            return None
        key = spec.key
        future = self._compiling.get(key)
        if future is None:
            future = asyncio.get_running_loop().run_in_executor(self._pool, self.compiler.compile, spec)
            self._compiling[key] = future
            future.add_done_callback(lambda f: self._done(key, f))
        return future

    def _done(self, key: tuple, future: asyncio.Future) -> None:
        if self._compiling.get(key) is future:
            del self._compiling[key]
        if not future.cancelled():
            future.exception()  # retrieved: a refused spec is its requests' error, not a loop warning

    async def prepare(self, spec: StructuredOutput | None) -> None:
        """Return once ``spec`` is compiled and cached; InvalidArgument if it does not compile, or
        not within the time limit."""
        future = self.start(spec)
        if future is None:
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                await asyncio.shield(future)  # a caller that leaves does not stop others' compile
        except TimeoutError:
            log.warning("a structured_output.%s took over %g s to compile; its request is refused", spec.kind,
                        self.timeout_s)
            raise InvalidArgument(f"sampling.structured_output.{spec.kind} is too complex: it did not compile "
                                  f"within {self.timeout_s:g} s (--grammar-compile-timeout-s)") from None
        except ValueError as e:
            raise InvalidArgument(f"sampling.{e}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
