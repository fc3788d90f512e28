"""A worker's part of the cluster's prefix directory (splitserve/state/prefixes.py): what its
engine's prefix blocks did since the last update (``PrefixHoldings.delta``, read between two
engine steps), written to Redis a few times a second.

Nothing is lost when Redis is away or the directory expired: the next update after a failure,
or one that finds the worker's hash gone, writes everything the worker holds instead.
"""
from __future__ import annotations

import asyncio
import logging
import time

from splitserve.common.aio import STOP_TIMEOUT_S, cancel_and_wait
from splitserve.state import prefixes

log = logging.getLogger(__name__)

# How often changes go out: a request placed on a stale entry in between recomputes its prefix.
INTERVAL_S = 0.2
# The directory of a worker that stops updating (killed, cut off from Redis) expires after this;
# gateways ignore a dead worker's at once (they look up live workers only).
TTL_S = 30.0
# With nothing to tell, the TTL is still refreshed this often.
REFRESH_S = TTL_S / 6


class PrefixPublisher:
    def __init__(self, state, worker_id: str, loop, holdings, interval_s: float = INTERVAL_S,
                 ttl_s: float = TTL_S):
        """``state``: a ``RedisState`` over an asyncio client; ``loop``: the worker's ``EngineLoop``,
        whose thread owns ``holdings`` (``KVCacheManager.holdings``)."""
        self.state = state
        self.worker_id = worker_id
        self.loop = loop
        self.holdings = holdings
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self._task: asyncio.Task | None = None

    def start(self) -> "PrefixPublisher":
        self._task = asyncio.get_running_loop().create_task(self._run(), name="prefix-publisher")
        return self

    def _read(self, everything: bool):
        """On the engine thread: the delta, and with ``everything`` all that is held after it."""
        delta = self.holdings.delta()
        return delta, (dict(self.holdings.published) if everything else None)

    async def _run(self) -> None:
        replace, refreshed = True, 0.0  # a (re)started worker's old entries go first
        while self.loop.alive:
            try:
                delta, everything = await self.loop.run(lambda: self._read(replace), timeout=None)
                if replace or delta.held or delta.gone or time.monotonic() - refreshed > REFRESH_S:
                    kept = await prefixes.publish(self.state, self.worker_id, everything if replace else delta.held,
                                                  [] if replace else delta.gone, self.ttl_s, replace=replace)
                    refreshed = time.monotonic()
                    replace = not kept
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away, or the engine stopped: all of it once Redis is back
                log.warning("prefix directory update failed: %s", e)
                replace = True
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        """Stop updating (``deregister`` deletes the directory's entries with the record)."""
        await cancel_and_wait(self._task, timeout_s=STOP_TIMEOUT_S)
