"""Small asyncio helpers shared by the servers."""
from __future__ import annotations

import asyncio
import io
import logging
from typing import Any, Awaitable, Coroutine

log = logging.getLogger(__name__)

# How long a shutdown waits for a component's task to end after its cancel (cancel_and_wait's
# timeout_s); one ends in milliseconds, unless something it awaits swallowed the cancel.
STOP_TIMEOUT_S = 10.0

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


async def cancel_and_wait(*tasks: asyncio.Task | None, timeout_s: float | None = None) -> None:
    """Cancel a component's own tasks and wait until they have ended (their ``finally`` ran).

    ``timeout_s``: wait that long at most. A task still running then kept going after its cancel
    (something it awaited swallowed it); it is logged with its stack and left, so a shutdown
    step goes on: a worker's drain must not wait on its heartbeat (a SIGTERMed worker once sat
    two minutes between NOT_SERVING and its drain, inside its heartbeat's or prefix publisher's
    stop)."""
    running = [t for t in tasks if t is not None]
    for task in running:
        task.cancel()
    if not running:
        return
    if timeout_s is None:
        await asyncio.gather(*running, return_exceptions=True)
        return
    _, stuck = await asyncio.wait(running, timeout=timeout_s)
    for task in stuck:
        stack = io.StringIO()
        task.print_stack(file=stack)
        log.error("task %s still runs %g s after it was cancelled; going on without it. %s",
                  task.get_name(), timeout_s, stack.getvalue())


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
