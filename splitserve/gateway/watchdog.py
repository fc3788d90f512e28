"""The gateway's watchdog: liveness of this gateway, of the workers under its requests, of claims.

Every ``WATCH_INTERVAL_S`` it

* refreshes this gateway's alive key (other gateways fail its queued requests once it lapses:
  nobody would be there to stream them);
* fails the queued requests of gateways whose alive key lapsed (``RedisState.fail_orphans``),
  wherever they wait in the queue, so a killed gateway's requests free their room within its
  TTL plus a round instead of waiting behind a head that may not move for long (only once Redis
  answered for a whole TTL: after an outage the other gateways get time to beat again);
* checks the workers under running requests: one gone from the registry (no heartbeat) that
  also ignores a direct health probe is dead or frozen, so its requests' attempts are declared
  lost (``Job.lost``) and cancelled, and the dispatcher retries them elsewhere (the probe keeps
  a Redis hiccup or a draining, deregistered worker from costing anyone an attempt);
* every ``RENEW_S``: renews the claim leases of this gateway's running requests, and fails
  claimed requests whose gateway stopped renewing (it died with their client streams);
* every ``QUEUED_CHECK_S``: reads the Redis state of its queued requests, and ends those that
  someone else ended (an Abort through another gateway, a claim that judged this gateway dead)
  -- the wake channel normally says so at once; this catches a message lost in an outage; and
  adopts those that Redis shows claimed under an epoch this gateway never heard of: its claim
  ran, and its reply was lost (without this the request waited forever, its lease unrenewed and
  unreaped, since its gateway still holds it).

Redis away: a round is skipped (the outage policy of ``splitserve/gateway/ledger.py``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Iterable

from splitserve.gateway.claim import CLAIM_LEASE_S
from splitserve.gateway.job import Finished, Job, JobState, cancelled, unavailable
from splitserve.gateway.ledger import OUTAGE
from splitserve.gateway.workers import WorkerDirectory
from splitserve.common.aio import cancel_and_wait
from splitserve.state.store import Claimed

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 1.0
# A gateway is alive while its key lives: several missed beats, not one slow round.
GATEWAY_TTL_S = 5.0
RENEW_S = CLAIM_LEASE_S / 3
QUEUED_CHECK_S = 2.0
# What a queued request's Redis state says when someone else ended it (None: its record is gone).
TERMINAL = ("finished", "aborted", "failed", "deadline", None)


def ended_elsewhere(record: dict | None) -> Finished:
    """How a request that someone else ended in Redis ends for its client."""
    if record is None:
        return unavailable("the request's record disappeared from the request store")
    state, error = record.get("state"), str(record.get("error", ""))
    if state == "aborted":
        return cancelled(error or "aborted")
    return unavailable(error or f"the request ended elsewhere ({state})")


async def end_if_ended_elsewhere(state, job: Job) -> None:
    """A queued job whose Redis record says someone else ended it (or is gone) ends here too; a
    record still live (our own requeue or claim raced the news) leaves it alone."""
    record = await state.get(job.request_id)
    if (record is None or record.get("state") in TERMINAL) and job.state is JobState.QUEUED:
        job.finish(ended_elsewhere(record))


class Watchdog:
    def __init__(self, state, directory: WorkerDirectory, gateway_id: str, jobs: Callable[[], Iterable[Job]],
                 adopt: Callable[[Claimed], Awaitable[None]] | None = None, claiming: Callable[[], bool] = bool,
                 departed: Callable[[str], Finished | None] = lambda request_id: None):
        """``adopt(claimed)`` runs a claim whose reply was lost; ``claiming()`` says whether the
        claim loop waits for a reply now (the claims Redis shows are then perhaps that one's);
        ``departed(request_id)``: how the client of a request claimed at its admission left while
        it was admitted (``Dispatcher.forget``), else None; taken once."""
        self.state = state
        self.directory = directory
        self.gateway_id = gateway_id
        self.jobs = jobs
        self.adopt = adopt
        self.claiming = claiming
        self.departed = departed
        self._task: asyncio.Task | None = None

    def start(self) -> "Watchdog":
        self._task = asyncio.get_running_loop().create_task(self._run(), name="watchdog")
        return self

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def beat(self) -> None:
        await self.state.gateway_beat(self.gateway_id, GATEWAY_TTL_S)

    async def _run(self) -> None:
        last_renewal = last_queued_check = time.monotonic()
        # Since when Redis has answered every round. Other gateways' alive keys may have lapsed
        # during an outage (they beat once it is over, as this one does): judge them only once
        # each had a whole TTL to beat again.
        reachable_since: float | None = time.monotonic()
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            try:
                await self.beat()
                reachable_since = reachable_since or time.monotonic()
                if time.monotonic() - reachable_since >= GATEWAY_TTL_S:
                    await self.fail_orphans()
                await self.check_workers()
                if time.monotonic() - last_renewal > RENEW_S:
                    await self.renew_claims()
                    last_renewal = time.monotonic()
                if time.monotonic() - last_queued_check > QUEUED_CHECK_S:
                    await self.check_queued()
                    last_queued_check = time.monotonic()
            except OUTAGE as e:  # the registry is in Redis: judge no one meanwhile
                reachable_since = None
                log.warning("watchdog: request store unreachable: %s", e)
            except Exception:
                log.exception("watchdog failed")

    async def fail_orphans(self) -> None:
        failed = await self.state.fail_orphans()
        if failed:
            log.warning("failed %d queued requests of gateways that went away (nobody could stream them)", failed)

    async def check_workers(self) -> None:
        busy = [j for j in self.jobs() if j.state is JobState.RUNNING and j.lost is None and not j.finished]
        if not busy:
            return
        registered = {w.worker_id for w in await self.directory.list()}
        answers: dict[str, bool] = {}
        for job in busy:
            for worker in (job.prefill_worker, job.decode_worker):
                if worker is None or worker.worker_id in registered:
                    continue
                if worker.worker_id not in answers:
                    answers[worker.worker_id] = await self.directory.probe(worker) is not None
                if not answers[worker.worker_id] and job.state is JobState.RUNNING and job.lost is None:
                    job.lost = f"{worker.role} worker {worker.worker_id} stopped heartbeating and does not answer"
                    if job.task is not None:
                        job.task.cancel()
                    break

    async def renew_claims(self) -> None:
        now = time.time()
        for job in list(self.jobs()):
            if job.state in (JobState.PLACING, JobState.RUNNING):
                await self.state.extend_lease(job.request_id, job.epoch, CLAIM_LEASE_S, now)
        mine = {j.request_id for j in self.jobs()}
        for request_id in await self.state.inflight_expired(now, limit=64):
            if request_id in mine:
                continue
            gone = self.departed(request_id)
            if gone is not None:  # claimed as it was admitted, as its client left: never run here
                await self.state.finish(request_id, None, gone.terminal_state, finish_reason=gone.finish_reason,
                                        error=gone.message)
                continue
            log.warning("request %s: its gateway stopped renewing its claim; marking it failed", request_id)
            await self.state.finish(request_id, None, "failed", finish_reason="error",
                                    error="the gateway holding this request went away")

    async def check_queued(self) -> None:
        queued = [j for j in self.jobs() if j.state is JobState.QUEUED and not j.finished]
        if not queued:
            return
        states = await self.state.states([j.request_id for j in queued])
        for job, state in zip(queued, states):
            if state in TERMINAL and not job.finished and job.state is JobState.QUEUED:
                await end_if_ended_elsewhere(self.state, job)
            elif state != "queued" and self.adopt is not None:
                await self.adopt_lost_claim(job)

    async def adopt_lost_claim(self, job: Job) -> None:
        """``job`` waits here as queued, Redis shows it claimed: adopt the claim if it is a newer
        one (a requeue on its way to Redis shows the job's own epoch) and no claim is in flight."""
        record = await self.state.get(job.request_id)
        if record is None or record.get("state") in TERMINAL + ("queued",) or record.get("gateway") != self.gateway_id:
            return
        if job.state is not JobState.QUEUED or job.finished or self.claiming() or record["epoch"] <= job.epoch:
            return
        log.warning("request %s: its claim (epoch %d) ran in Redis but the reply was lost; running it now",
                    job.request_id, record["epoch"])
        await self.adopt(Claimed(job.request_id, record["epoch"], record["attempt"]))
