"""The gateway's check of a structured-output spec, in a child process.

The workers compile every grammar with xgrammar; the gateway refuses one that xgrammar cannot
take before the request is queued, with a message naming the field. It cannot call xgrammar
itself: the library loads torch, which the gateway never loads, and a deeply nested schema can
compile for seconds, which must not stop the event loop every stream of the gateway runs on.
So a child process (``python -m splitserve.engine.grammar_server``) checks specs one at a time,
started at the first spec; a check that outlives ``timeout_s`` refuses its request, and the
child is killed and started again for the next one. Answers are remembered (``CACHE_SIZE``
distinct specs), so a spec many requests share is checked once.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import sys

from splitserve.common.aio import wait_for
from splitserve.common.errors import InvalidArgument, Unavailable
from splitserve.common.processes import die_with_parent
from splitserve.engine.structured_output import StructuredOutput

log = logging.getLogger(__name__)

# Seconds one spec may take to compile before its request is refused.
TIMEOUT_S = 10.0
# Distinct specs whose answers are remembered (least recently used forgotten first).
CACHE_SIZE = 1024
# Seconds the child may take to start (Python, xgrammar and torch imports on a busy box).
START_TIMEOUT_S = 60.0


class GrammarChecker:
    def __init__(self, timeout_s: float = TIMEOUT_S, cache_size: int = CACHE_SIZE):
        self.timeout_s = timeout_s
        self._answers: collections.OrderedDict[tuple, str | None] = collections.OrderedDict()
        self._cache_size = cache_size
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()  # one spec in the child at a time: answers come in order
        self._ids = itertools.count()

    async def check(self, spec: StructuredOutput) -> None:
        """Return if the workers' grammar library takes ``spec``; InvalidArgument naming the field
        (``sampling.structured_output.<kind> ...``) if it refuses it or takes too long."""
        key = spec.key
        if key in self._answers:
            self._answers.move_to_end(key)
        else:
            self._remember(key, await self._ask(spec))
        error = self._answers[key]
        if error is not None:
            raise InvalidArgument(f"sampling.{error}")

    def _remember(self, key: tuple, error: str | None) -> None:
        self._answers[key] = error
        while len(self._answers) > self._cache_size:
            self._answers.popitem(last=False)

    async def _ask(self, spec: StructuredOutput) -> str | None:
        kind, value = spec.key
        line = json.dumps({"id": next(self._ids), "kind": kind, "value": value}) + "\n"
        async with self._lock:
            proc = await self._child()
            try:
                proc.stdin.write(line.encode())
                await proc.stdin.drain()
                answer = await wait_for(proc.stdout.readline(), self.timeout_s)
            except asyncio.TimeoutError:
                log.warning("a structured_output.%s took over %.0f s to compile; refused, checker restarted",
                            kind, self.timeout_s)
                await self._stop()
                return (f"structured_output.{kind} is too complex: it did not compile within "
                        f"{self.timeout_s:g} s")
            except (BrokenPipeError, ConnectionResetError):
                answer = b""
            if not answer:  # the child died (out of memory on a huge grammar, say)
                await self._stop()
                raise Unavailable("the grammar checker of this gateway stopped; retry the request")
            return json.loads(answer)["error"]

    async def _child(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "splitserve.engine.grammar_server", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, limit=2**20, preexec_fn=die_with_parent())
            try:
                ready = await wait_for(self._proc.stdout.readline(), START_TIMEOUT_S)
            except asyncio.TimeoutError:
                ready = b""
            if not ready:
                await self._stop()
                raise Unavailable("the grammar checker of this gateway did not start; retry the request")
        return self._proc

    async def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def close(self) -> None:
        await self._stop()
