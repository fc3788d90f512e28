"""The gateway's Redis writes and its one policy for a Redis outage.

Redis holds every durable fact of a request, so when it cannot be reached the gateway must
decide, per kind of access, between failing now, waiting, and doing without. One policy:

* **admission and reads for clients** (``Generate``, ``GetRequest``, ``GetServerInfo``,
  ``Abort`` of a queued request): fail at once with ``UNAVAILABLE`` -- no new work is taken
  while it could not be tracked, and the client may retry elsewhere;
* **writes a request's life depends on** (putting it back in the queue, its terminal state):
  retried every ``RETRY_S`` until Redis answers -- a requeue for at most ``REQUEUE_WAIT_S`` (then
  the request fails with ``UNAVAILABLE``), a terminal state for at most ``END_WAIT_S`` (in the
  background: the client already has its answer; then given up and logged), so no record stays
  live and no queue slot stays taken once Redis is back;
* **progress notes** (state, worker ids; only GetRequest reads them) and the placement gate:
  best effort, dropped (the gate lapses by itself);
* **claims, lease renewals, the watchdog's checks**: their loops skip a round and try again.

Requests already on their workers keep streaming through an outage: nothing on that path
touches Redis until the end.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import redis

from splitserve.common.errors import Unavailable

log = logging.getLogger(__name__)

# Pause between tries of a write that must land.
RETRY_S = 0.5
# How long a request waits (out of the queue, between attempts) for Redis to take it back.
REQUEUE_WAIT_S = 30.0
# How long a terminal state that Redis could not take is kept for another try.
END_WAIT_S = 600.0

# What an outage looks like from redis-py (a refused or broken connection, a timeout, a Redis
# still loading its append-only file). Other errors are bugs and propagate.
OUTAGE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


class Ledger:
    def __init__(self, state):
        """``state``: the gateway's asyncio ``RedisState``."""
        self.state = state
        self._writes: set[asyncio.Task] = set()  # terminal states and notes still on their way
        self._notes: dict[str, asyncio.Task] = {}  # each request's latest note on its way
        self._ends: dict[str, asyncio.Task] = {}  # each request's latest terminal state on its way

    # ---- fail at once ------------------------------------------------------------------
    async def now(self, awaitable: Awaitable):
        """A call a client waits on: Redis away means ``Unavailable`` at once, never a hang."""
        try:
            return await awaitable
        except OUTAGE as e:
            raise Unavailable(f"request store (Redis) unreachable: {e}") from e

    # ---- must land -----------------------------------------------------------------------
    async def must(self, call: Callable[[], Awaitable], give_up_s: float, what: str,
                   stop: Callable[[], bool] = lambda: False):
        """``await call()`` until Redis takes it; ``Unavailable`` after ``give_up_s`` of outage
        (or at once once ``stop()`` says the write no longer matters, ``None`` returned)."""
        give_up = time.monotonic() + give_up_s
        while True:
            try:
                return await call()
            except OUTAGE as e:
                if time.monotonic() > give_up:
                    raise Unavailable(f"request store (Redis) unreachable for {give_up_s:.0f} s ({what}): {e}") from e
                log.warning("%s: Redis unreachable (%s); trying again", what, e)
            await asyncio.sleep(RETRY_S)
            if stop():
                return None

    def record_end(self, request_id: str, state: str, **fields) -> None:
        """The request's terminal state, written once, in the background (the client already has
        its answer), retried through an outage. Ends of one request land in the order they were
        made, so the first one made is the one Redis keeps (``finish`` keeps the first): a
        deadline recorded as the job ended here is not overtaken by the "nobody is waiting"
        abort of a claim whose reply came back just after (each write takes its own connection
        from the pool, and a later one could reach Redis first)."""
        before = self._ends.get(request_id)

        async def write():
            if before is not None:
                await asyncio.wait([before])
            try:
                await self.must(lambda: self.state.finish(request_id, None, state, **fields), END_WAIT_S,
                                f"recording the end of {request_id}")
            except Unavailable as e:
                log.error("gave up recording the end of %s: %s", request_id, e)
        self._track(self._ends, request_id, asyncio.get_running_loop().create_task(write()))

    def _track(self, latest: dict[str, asyncio.Task], request_id: str, task: asyncio.Task) -> None:
        """``task`` is the latest write of its kind for ``request_id`` (the next one waits for it)."""
        latest[request_id] = task
        self._writes.add(task)

        def done(t: asyncio.Task) -> None:
            self._writes.discard(t)
            if latest.get(request_id) is t:
                del latest[request_id]
        task.add_done_callback(done)

    async def requeue(self, request_id: str, epoch: int | None, stop: Callable[[], bool]) -> bool:
        """Back in the queue in its old place; ``Unavailable`` if Redis stays away too long."""
        return bool(await self.must(lambda: self.state.requeue(request_id, epoch), REQUEUE_WAIT_S,
                                    f"requeueing {request_id}", stop))

    # ---- best effort ---------------------------------------------------------------------
    def note_soon(self, request_id: str, epoch: int, **fields) -> None:
        """``note``, in the background: nothing waits on it (a request's next step must not wait
        for a Redis round trip). A note that lands late changes nothing that came after it: the
        store takes no progress of an ended request, of one put back in the queue, or of another
        epoch. Notes of one request land in the order they were made."""
        before = self._notes.get(request_id)

        async def write():
            if before is not None:
                await asyncio.wait([before])
            await self.note(request_id, epoch, **fields)
        self._track(self._notes, request_id, asyncio.get_running_loop().create_task(write()))

    async def note(self, request_id: str, epoch: int, **fields) -> None:
        """Progress for GetRequest: an outage must not fail the request."""
        try:
            await self.state.update(request_id, epoch, **fields)
        except OUTAGE as e:
            log.warning("could not record the progress of %s: %s", request_id, e)

    async def placed(self, request_id: str) -> None:
        """Open the placement gate (it lapses by itself if Redis does not take this)."""
        try:
            await self.state.placed(request_id)
        except OUTAGE as e:
            log.warning("could not open the placement gate after %s: %s", request_id, e)

    # ---- shutdown ------------------------------------------------------------------------
    async def flush(self, timeout_s: float) -> None:
        """Wait (bounded) for terminal states still on their way."""
        if self._writes:
            await asyncio.wait(set(self._writes), timeout=timeout_s)
