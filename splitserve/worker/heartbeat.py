"""Workers announce themselves in Redis and keep a heartbeat; a worker that stops beating
drops out of every gateway's view once its alive key expires.

The heartbeat is an asyncio task on the worker's event loop. Its stats come from the engine
loop with a short timeout: a multi-second engine step must not make a healthy worker miss its
beat and drop out of the registry, so mid-step it beats with the numbers from before the step.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from splitserve.common.aio import STOP_TIMEOUT_S, cancel_and_wait, wait_for

log = logging.getLogger(__name__)

# How long a beat waits for fresh engine stats before it reuses the last ones.
STATS_TIMEOUT_S = 0.5


class Heartbeat:
    def __init__(self, state, worker_id: str, role: str, address: str, transports: list[str],
                 stats: Callable[[], Awaitable[dict]], interval_s: float = 1.0, ttl_s: float = 3.0):
        """``state``: a ``RedisState`` over an asyncio client; ``stats()``: the worker's load."""
        self.state = state
        self.worker_id = worker_id
        self.role = role
        self.address = address
        self.transports = transports
        self.stats = stats
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self._task: asyncio.Task | None = None

    def start(self) -> "Heartbeat":
        self._task = asyncio.get_running_loop().create_task(self._run(), name="heartbeat")
        return self

    async def _run(self) -> None:
        registered = False
        while True:
            try:
                stats = await self.stats()
                if not registered:
                    await self.state.register_worker(self.worker_id, self.role, self.address, self.transports,
                                                     stats, self.ttl_s)
                    registered = True
                    log.info("registered %s (%s) at %s", self.worker_id, self.role, self.address)
                else:
                    # False: our alive key lapsed and gateways may have dropped us; register anew.
                    registered = await self.state.heartbeat(self.worker_id, stats, self.ttl_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away: keep trying; gateways drop us meanwhile
                log.warning("heartbeat failed: %s", e)
                registered = False
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        """Stop beating and leave the registry at once (graceful shutdown)."""
        await cancel_and_wait(self._task, timeout_s=STOP_TIMEOUT_S)
        try:
            await wait_for(self.state.deregister(self.worker_id), 5)
        except Exception as e:
            log.warning("deregister failed: %s", e)


def engine_stats(loop, stats: Callable[[], dict], extra: dict) -> Callable[[], Awaitable[dict]]:
    """``stats()`` read on the engine loop, or the last numbers while a long step runs."""
    last: dict = {}

    async def read() -> dict:
        try:
            last.update(await loop.run(stats, timeout=STATS_TIMEOUT_S))
        except asyncio.TimeoutError:
            pass  # mid-step: beat with the numbers from before it
        return {**last, **extra}
    return read
