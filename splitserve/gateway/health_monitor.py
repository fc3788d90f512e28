"""The gateway's readiness (grpc.health.v1 ``splitserve.v1.Generation``) means "can do work now".

SERVING only while Redis answers and the registry holds a set of workers that can serve a
request (a prefill and a decode worker, or a colocated one), and not while draining. A load
balancer or compose health check reading it stops sending traffic that would only fail.
Liveness (the empty service name) stays SERVING meanwhile: see ``splitserve.common.grpc_server``.
The status is refreshed by a task every ``interval_s``; a health check itself only reads it,
so it is answered at once however busy the gateway is. While no usable set of workers is
registered, the refresh comes every ``NOT_READY_INTERVAL_S`` and reads the registry afresh: a
gateway booting beside its workers turns ready as soon as they register, not up to 1.5 s later
(the interval and the directory's cache), which every start of a stack waited for.
"""
from __future__ import annotations

import asyncio
import logging

from splitserve.common.aio import cancel_and_wait
from splitserve.common.grpc_server import set_health

log = logging.getLogger(__name__)

NO_WORKERS = ("no usable workers: a prefill and a decode worker, or a colocated one, must be registered (or a "
              "decode worker alone, under --disaggregation never or auto)")
STORE_DOWN = "request store (Redis) unreachable"
# How often the status is refreshed while no usable set of workers is registered (one Redis read
# of the registry each; not while Redis is down or the gateway drains: nothing to wait for there).
NOT_READY_INTERVAL_S = 0.1


def public_reason(reason: str) -> str:
    """What an unauthenticated caller may read of why the gateway cannot serve: no error text."""
    if not reason:
        return ""
    if reason.startswith(NO_WORKERS):
        return "no usable workers"
    if reason.startswith(STORE_DOWN):
        return "request store unreachable"
    return "draining" if reason == "draining" else "unavailable"


class GatewayHealth:
    def __init__(self, health, services: list[str], state, directory, interval_s: float = 1.0):
        self.health = health
        self.services = list(services)
        self.state = state
        self.directory = directory
        self.interval_s = interval_s
        self.draining = False
        self.reason = ""
        self._task: asyncio.Task | None = None

    async def start(self) -> "GatewayHealth":
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="health")
        return self

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    @property
    def no_workers(self) -> bool:
        """No usable set of workers is registered (new requests would only wait, then fail)."""
        return self.reason.startswith(NO_WORKERS)

    async def drain(self) -> None:
        self.draining = True
        await self.refresh()

    async def check(self) -> str:
        """Why the gateway cannot serve now ("" when it can)."""
        if self.draining:
            return "draining"
        try:
            await self.state.ping()
            if self.no_workers:  # a worker that registered just now counts now
                self.directory.invalidate()
            roles = {w.role for w in await self.directory.usable()}
            if await self.directory.can_serve():
                return ""
        except Exception as e:  # Redis down or unreachable
            return f"{STORE_DOWN}: {e}"
        return f"{NO_WORKERS} (registered: {', '.join(sorted(roles)) or 'none'})"

    async def refresh(self) -> None:
        reason = await self.check()
        if self.draining:  # drain() ran while this check waited for Redis: it wins
            reason = "draining"
        if reason != self.reason:
            # Draining is the gateway stopping as asked: not a warning.
            log.log(logging.WARNING if reason and reason != "draining" else logging.INFO, "health: %s",
                    reason or "serving")
            self.reason = reason
        await set_health(self.health, self.services, serving=not reason)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(NOT_READY_INTERVAL_S if self.no_workers else self.interval_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("health refresh failed")
