"""Small asyncio helpers shared by the servers."""
from __future__ import annotations

import asyncio
import logging
from typing import Coroutine

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
