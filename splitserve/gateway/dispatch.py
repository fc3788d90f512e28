"""Runs admitted requests on the workers: the gateway's table of jobs and the parts that move them.

* ``ClaimLoop`` (``splitserve/gateway/claim.py``) takes this gateway's requests from the global Redis
  queue in its order, one placement at a time;
* ``run_attempt`` (``splitserve/gateway/attempt.py``) runs one try of a request on workers;
* ``Watchdog`` (``splitserve/gateway/watchdog.py``) keeps liveness and claims, and declares attempts on
  dead or frozen workers lost;
* ``Ledger`` (``splitserve/gateway/ledger.py``) writes to Redis under the one outage policy.

This module decides what follows an attempt: a request that found no room, or no usable
workers yet, goes back to the queue in its old place; one whose worker died, froze or voided
its handoff goes back too, once per attempt up to ``max_attempts`` (Redis bumps the attempt and
the epoch, which fences off the old attempt's writes; the next attempt prefills the prompt
plus the tokens already streamed, so no token is sent twice), then fails with UNAVAILABLE.

Each request's end has one owner, ``Job.finish``; when it fires, ``_ended`` records the
terminal state once and frees the request's slot here.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from splitserve.gateway.attempt import NO_ROOM_BACKOFF_S, NO_WORKER_BACKOFF_S, Retry, decide, run_attempt
from splitserve.gateway.claim import ClaimLoop
from splitserve.gateway.job import Finished, Job, JobState, cancelled, unavailable
from splitserve.gateway.ledger import Ledger
from splitserve.gateway.watchdog import Watchdog, end_if_ended_elsewhere
from splitserve.gateway.workers import WorkerDirectory
from splitserve.common.aio import spawn, wait_for
from splitserve.common.errors import Unavailable

log = logging.getLogger(__name__)

# Pause before a retry, times the attempt number: a restarting worker gets a moment.
RETRY_BACKOFF_S = 0.2
# Requests whose client left during their admission, remembered until their claim (see forget).
# An admission Redis never took is never claimed; the oldest are let go past this many.
DEPARTED_KEPT = 1024


class Dispatcher:
    def __init__(self, state, directory: WorkerDirectory, gateway_id: str, max_attempts: int = 3, on_retry=None):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.state = state
        self.directory = directory
        self.gateway_id = gateway_id
        self.max_attempts = max_attempts
        self.on_retry = on_retry  # called with the reason of each retry (metrics)
        self.ledger = Ledger(state)
        self.jobs: dict[str, Job] = {}
        self._departed: OrderedDict[str, Finished] = OrderedDict()  # request id -> how its client left
        self.claims = ClaimLoop(state, gateway_id, self._start_attempt, self._ended_in_redis,
                                needs_gate=self._needs_gate)
        self.watchdog = Watchdog(state, directory, gateway_id, lambda: list(self.jobs.values()),
                                 adopt=self._adopt_lost_claim, claiming=lambda: self.claims.claiming,
                                 departed=lambda request_id: self._departed.pop(request_id, None))

    async def start(self) -> "Dispatcher":
        await self.watchdog.beat()  # alive before the first admission: others keep its requests
        self.claims.start()
        self.watchdog.start()
        return self

    # ---- jobs -----------------------------------------------------------------------------
    def new_job(self, request_id: str, prompt_token_ids: list[int], params, priority: int, arrival_s: float,
                deadline: float | None, text=None, owner: str = "") -> Job | None:
        """A job for a request about to be admitted; None if this gateway already runs that id."""
        if request_id in self.jobs:
            return None
        job = Job(request_id, prompt_token_ids, params, priority, arrival_s, deadline, on_finish=self._ended,
                  text=text, owner=owner)
        self.jobs[request_id] = job
        return job

    def admitted(self, job: Job, claimed=None) -> None:
        """Redis took the job's request: it waits in the queue (unless something already ended
        it, or the claim loop already took it); ``claimed``: the admission claimed it too
        (``claim_at_admission``), and its attempt starts now."""
        if job.state is JobState.ADMITTING:
            job.state = JobState.QUEUED
        if claimed is not None:
            self._start_attempt(claimed, gated=False).add_done_callback(self.claims.placement_decided)
            return
        self.claims.wake()

    async def claim_at_admission(self) -> bool:
        """Whether admissions may claim their request in the same Redis call: placements take no
        capacity (no gate), so a request at the head of the queue would be the claim loop's next
        claim anyway (``RedisState.admit(claim_lease_s=...)``)."""
        return not await self._needs_gate()

    def forget(self, job: Job, departed: Finished | None = None) -> None:
        """A job whose admission was refused or abandoned: it never existed here. ``departed``:
        its client left (or its deadline passed) while Redis took it. Redis may then hold the
        request, and this gateway's claim loop claim it (or the admission have claimed it, its
        lease left to lapse: the watchdog); that claim records ``departed`` as its end, not
        "nobody is waiting" nor "the gateway went away". The job cannot end itself: Redis may
        have refused the request as a duplicate of another's, whose record a blind end would
        overwrite."""
        if self.jobs.get(job.request_id) is job:
            del self.jobs[job.request_id]
            if departed is not None:
                self._departed[job.request_id] = departed
                while len(self._departed) > DEPARTED_KEPT:
                    self._departed.popitem(last=False)

    def cancel(self, request_id: str, outcome: Finished | None = None) -> bool:
        """End a running request here (Abort): True if this gateway had it and it had not ended."""
        job = self.jobs.get(request_id)
        return job is not None and job.finish(outcome or cancelled("aborted"))

    def _ended(self, job: Job) -> None:
        """``Job.finish`` fired: the one terminal write, the slot freed, capacity may be free."""
        if self.jobs.get(job.request_id) is job:
            del self.jobs[job.request_id]
        outcome = job.outcome
        log.log(logging.WARNING if outcome.status else logging.INFO, "%s: %s%s", job.request_id,
                outcome.finish_reason, f" ({outcome.status.name}: {outcome.message})" if outcome.status else "")
        self.ledger.record_end(job.request_id, job.outcome.terminal_state, **job.terminal_fields())
        self.claims.room()

    def _ended_in_redis(self, request_id: str) -> None:
        """Someone ended ``request_id`` in Redis; if this gateway still waits on it, end it here too."""
        job = self.jobs.get(request_id)
        if job is not None and job.state is JobState.QUEUED and not job.finished:
            spawn(end_if_ended_elsewhere(self.state, job))

    # ---- attempts -------------------------------------------------------------------------
    async def _needs_gate(self) -> bool:
        """Placements take capacity (a Reserve) when any usable decode-capable worker is decode-only."""
        return any(w.role == "decode" for w in await self.directory.usable())

    def _start_attempt(self, claimed, gated: bool) -> asyncio.Future:
        """The claim loop took ``claimed``: run it; the future says whether to claim on."""
        decided = asyncio.get_running_loop().create_future()
        job = self.jobs.get(claimed)
        if job is None:  # its handler is gone (the client left, or an earlier life of this gateway)
            gone = self._departed.pop(claimed, None) or cancelled("nobody is waiting for this request any more")
            self.ledger.record_end(claimed, gone.terminal_state, finish_reason=gone.finish_reason, error=gone.message)
            decided.set_result(True)
            return decided
        if job.finished:  # its end, on its way to Redis, takes it out of the queues
            decided.set_result(True)
            return decided
        if job.state in (JobState.PLACING, JobState.RUNNING):
            # Claimed again while an attempt runs here: Redis lost its writes since the last
            # claim (restarted from an older AOF or snapshot) and queued the request again, under
            # an epoch the running attempt may hold too. A second attempt would stream the request
            # twice; the running one keeps it, under the new epoch (the only one Redis accepts).
            log.warning("%s was claimed again (epoch %d) while its attempt (epoch %d) runs here: Redis lost "
                        "writes; the running attempt goes on", job.request_id, claimed.epoch, job.epoch)
            job.epoch = claimed.epoch
            if gated:
                spawn(self.ledger.placed(job.request_id))
            spawn(self.ledger.note(job.request_id, job.epoch, state="decoding" if job.decoding else "prefilling"))
            decided.set_result(True)
            return decided
        job.epoch, job.attempt, job.lost, job.gated = claimed.epoch, claimed.attempt, None, gated
        job.state = JobState.PLACING
        job.trace.claimed(claimed.attempt)
        job.task = spawn(self._run(job, decided), name=f"attempt-{job.request_id}")
        return decided

    async def _adopt_lost_claim(self, claimed) -> None:
        """The watchdog found a claim of this gateway whose reply never came (the connection
        dropped after Redis ran it): run it as the claim loop would have."""
        gated = await self._needs_gate()
        job = self.jobs.get(claimed)
        if job is not None and job.state is JobState.QUEUED and not job.finished:
            self._start_attempt(claimed, gated)

    async def _run(self, job: Job, decided: asyncio.Future) -> None:
        try:
            await self._attempt_and_follow_up(job, decided)
        except BaseException as exc:
            # Only ``Job.finish`` may end a request; a job whose task died any other way would
            # hang its client with nothing in the log. Never silently: end it here, and say why.
            if not job.finished:
                log.error("the attempt task of %s ended without ending the request", job.request_id,
                          exc_info=exc if not isinstance(exc, asyncio.CancelledError) else None)
                job.finish(unavailable("the gateway lost track of this request's attempt; retry it"))
            raise

    async def _attempt_and_follow_up(self, job: Job, decided: asyncio.Future) -> None:
        try:
            outcome = await run_attempt(job, self.directory, self.ledger, decided)
        finally:
            decide(decided, True)
        if outcome is None or job.finished:
            return
        if isinstance(outcome, Retry):
            if self.on_retry is not None:
                self.on_retry(outcome.reason)
            log.warning("attempt %d of %s failed: %s", job.attempt, job.request_id, outcome.reason)
            if job.attempt >= self.max_attempts:
                job.finish(unavailable(f"gave up after {job.attempt} attempts; last: {outcome.reason}"))
                return
            await asyncio.sleep(RETRY_BACKOFF_S * job.attempt)
        else:
            await asyncio.sleep(NO_ROOM_BACKOFF_S if outcome.no_room else NO_WORKER_BACKOFF_S)
        await self._requeue(job)

    async def _requeue(self, job: Job) -> None:
        """Back in the queue in its old place (Redis keeps its score)."""
        job.state = JobState.QUEUED
        job.trace.queued()
        try:
            requeued = await self.ledger.requeue(job.request_id, job.epoch, stop=lambda: job.finished)
        except Unavailable as e:
            job.finish(unavailable(str(e)))
            return
        if not requeued and not job.finished:
            job.finish(unavailable("the request could not go back to the queue (its record changed meanwhile)"))
        self.claims.wake()

    # ---- shutdown -------------------------------------------------------------------------
    async def drain(self, timeout_s: float) -> None:
        """Wait (bounded) for the requests in flight to end; end the rest with UNAVAILABLE."""
        give_up = time.monotonic() + timeout_s
        while self.jobs and time.monotonic() < give_up:
            await asyncio.sleep(0.1)
        for job in list(self.jobs.values()):
            log.warning("request %s still running at the end of the drain; ending it", job.request_id)
            job.finish(unavailable("the gateway shut down before the request finished; retry it"))
        await self.ledger.flush(5.0)

    async def stop(self) -> None:
        await self.claims.stop()
        await self.watchdog.stop()
        try:
            await wait_for(self.state.gateway_leave(self.gateway_id), 2)
        except Exception as e:
            log.warning("could not leave the gateway registry: %s", e)
