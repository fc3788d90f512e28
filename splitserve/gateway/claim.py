"""The claim loop: takes this gateway's requests from the global Redis queue, in its order.

Every gateway runs one. A claim succeeds only for the head of the one queue shared by all
gateways, and only for the gateway that admitted it (it holds the client's stream); while
another gateway's request is at the head, or any request is being placed on workers, nobody
claims (see ``splitserve/state/scripts.py``). So requests take free capacity in queue order,
whichever gateway they came through.

Placements that take no capacity (every usable decode-capable worker is colocated: its engine
queues the request itself, in the same order) need no gate, and then up to ``BATCH`` consecutive
heads of this gateway are claimed at once: one Redis call for a burst, not one per request.

The loop sleeps until something may have changed: a message on the Redis wake channel
(an admission, a placement decided, a requeue, a request ending anywhere), a local admission,
or a short recheck interval (a lost message costs at most that). After a placement that found
no room it waits for a request to end (capacity to come free) before it claims again.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Awaitable, Callable

from splitserve.gateway.ledger import OUTAGE
from splitserve.common.aio import cancel_and_wait, wait_for

log = logging.getLogger(__name__)

# Seconds a request may sit claimed before a reaper could fail it (renewed while it runs).
CLAIM_LEASE_S = 30.0
# Longest a placement may hold the gate (a decode worker's Reserve answers between two steps).
PLACE_LEASE_S = 5.0
# Look again this often even without a wake message.
RECHECK_S = 0.25
# After "no room": wait for a request to end, or this long.
NO_ROOM_RECHECK_S = 0.25
# Pause after a claim failed because Redis is away.
OUTAGE_PAUSE_S = 0.5
# Most requests one claim takes when no placement gate is needed.
BATCH = 64
# Fault injection for the hostile-input tests: the reply of the N-th claim that took something is
# dropped after Redis ran it, as when the connection breaks on its way back (0: never).
LOSE_CLAIM_REPLY_ENV = "SPLITSERVE_FAULT_LOSE_CLAIM_REPLY"


class ClaimLoop:
    def __init__(self, state, gateway_id: str, start_attempt: Callable, on_end_elsewhere: Callable[[str], None],
                 needs_gate: Callable[[], Awaitable[bool]]):
        """``start_attempt(claimed, gated)`` runs a claimed request and returns a future that says,
        once its placement is decided, whether to claim on (False: no room, pause);
        ``on_end_elsewhere(request_id)`` hears every request that ended (in Redis);
        ``needs_gate()`` says whether placements may take capacity (a decode-only worker is there)."""
        self.state = state
        self.gateway_id = gateway_id
        self.start_attempt = start_attempt
        self.needs_gate = needs_gate
        self.on_end_elsewhere = on_end_elsewhere
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._tasks: list[asyncio.Task] = []
        # Set by stop(): the loops end at their next turn even if a cancel is lost. redis-py reads
        # under a timeout, and a cancel arriving as that timeout fires can be swallowed (redis-py
        # issue 2551): the listener would then run on and stop() wait forever.
        self._stopping = False
        # True from sending a claim until its claimed requests are started: a request Redis
        # shows claimed meanwhile is this claim's, not one whose reply was lost.
        self.claiming = False
        self._lose_reply_at = int(os.environ.get(LOSE_CLAIM_REPLY_ENV, "0") or 0)
        self._replies = 0  # claims that took something, for the fault above

    def start(self) -> "ClaimLoop":
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._claim_loop(), name="claim-loop"),
                       loop.create_task(self._listen(), name="wake-listener")]
        return self

    async def stop(self) -> None:
        self._stopping = True
        await cancel_and_wait(*self._tasks)

    def wake(self) -> None:
        """Something may be claimable now (a local admission)."""
        self._wake.set()

    def room(self) -> None:
        """Capacity may have come free (a request ended)."""
        self._room.set()
        self._wake.set()

    def placement_decided(self, decided: "asyncio.Future[bool]") -> None:
        """The placement of a request claimed at its admission is decided: no room pauses the
        claims as after one of the loop's own."""
        if not decided.cancelled() and decided.exception() is None and not decided.result():
            self._room.clear()

    # ---- the loop ----------------------------------------------------------------------
    async def _claim_loop(self) -> None:
        while not self._stopping:
            if not self._room.is_set():
                await _wait(self._room, NO_ROOM_RECHECK_S)
                self._room.set()
            self._wake.clear()  # before the claim: a message from here on sets it again
            try:
                self.claiming = True
                gated = await self.needs_gate()
                claimed = await self.state.claim_many(self.gateway_id, CLAIM_LEASE_S, time.time(), PLACE_LEASE_S,
                                                      limit=1 if gated else BATCH, gate=gated)
                self._lose_reply_if_told(claimed)
                decided = [self.start_attempt(c, gated) for c in claimed]
            except OUTAGE as e:  # Redis down: new requests get UNAVAILABLE meanwhile
                # The claim may have run and only its reply been lost: the watchdog adopts such
                # claims (``Watchdog.check_queued``).
                log.warning("claim failed: %s", e)
                await asyncio.sleep(OUTAGE_PAUSE_S)
                continue
            except Exception:
                log.exception("claim failed")
                await asyncio.sleep(OUTAGE_PAUSE_S)
                continue
            finally:
                self.claiming = False
            if not claimed:
                await _wait(self._wake, RECHECK_S)
                continue
            done, _ = await asyncio.wait(decided, timeout=PLACE_LEASE_S + 1)
            if any(not f.result() for f in done):
                self._room.clear()

    def _lose_reply_if_told(self, claimed: list) -> None:
        if claimed and self._lose_reply_at > 0:
            self._replies += 1
            if self._replies == self._lose_reply_at:
                raise OUTAGE[0](f"fault injection ({LOSE_CLAIM_REPLY_ENV}): the reply of the claim of "
                                f"{', '.join(claimed)} was lost")

    async def _listen(self) -> None:
        """The wake channel: every gateway hears admissions, placements, requeues and ends."""
        while not self._stopping:
            pubsub = self.state.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.state.wake_channel)
                self._wake.set()  # (re)subscribed: whatever happened meanwhile was missed
                while not self._stopping:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    data = message["data"]
                    self._wake.set()
                    if data.startswith("end "):
                        self._room.set()
                        self.on_end_elsewhere(data[4:])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away: listen again once it is back
                log.warning("wake channel lost: %s", e)
                await asyncio.sleep(OUTAGE_PAUSE_S)
            finally:
                await asyncio.shield(_close(pubsub))


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    try:
        await wait_for(event.wait(), timeout_s)  # not asyncio's (splitserve.common.aio.wait_for says why)
    except TimeoutError:
        pass


async def _close(pubsub) -> None:
    try:
        await pubsub.aclose()
    except Exception:
        pass
