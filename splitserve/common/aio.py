"""Small asyncio helpers shared by the servers."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Coroutine

log = logging.getLogger(__name__)

# Fire-and-forget tasks: the event loop keeps only weak references, so they live here until done.
_background: set[asyncio.Task] = set()


def spawn(coro: Coroutine, name: str | None = None) -> asyncio.Task:
    """Run ``coro`` in the background (its exception, if any, is logged, never lost)."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    _background.add(task)
    task.add_done_callback(_done)
    return task


def _done(task: asyncio.Task) -> None:
    _background.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s failed", task.get_name(), exc_info=task.exception())


async def cancel_and_wait(*tasks: asyncio.Task | None) -> None:
    """Cancel a component's own tasks and wait until they have ended (their ``finally`` ran)."""
    running = [t for t in tasks if t is not None]
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)


async def wait_for(awaitable: Awaitable[Any], timeout: float | None) -> Any:
    """``asyncio.wait_for`` that never loses a cancellation; use it instead, everywhere.

    On Python 3.11, a cancel that lands as the awaited thing completes is swallowed by
    ``asyncio.wait_for`` (it returns the result; cpython gh-86296, fixed in 3.12): the cancelled
    task goes on as if nothing happened. A loop around it -- a heartbeat that reads the engine's
    stats through it every second, a watch -- then never ends, and ``cancel_and_wait`` waits on it
    for ever: a process stuck in its shutdown (the likely way one worker outlived ``kill -9`` of
    ``up`` by over 30 s in CI). ``asyncio.timeout`` has no such gap.
    Raises ``TimeoutError`` (the same class as ``asyncio.TimeoutError`` since 3.11)."""
    async with asyncio.timeout(timeout):
        return await awaitable
