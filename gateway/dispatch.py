"""Runs admitted requests on the workers: claim in priority order, reserve, prefill, decode, relay.

One claim loop per gateway takes the best queued request this gateway admitted (Redis holds
the order), then a pool thread runs it: a decode worker reserves pages, a prefill worker
writes the prompt's KV into them and returns the first token, the decode worker streams the
rest. A ``both`` worker does all of it itself. Tokens go to the request's ``Job.events``,
which the Generate handler streams to the client.

A worker that dies under a request (its calls fail with UNAVAILABLE, or it stops heartbeating
and does not answer a health probe) costs the request one attempt: the dispatcher aborts what
is left of it on its workers, puts it back in the queue in its old place (Redis counts the
attempt and bumps the epoch, which fences off the old attempt's writes), and the next attempt
prefills the prompt plus the tokens already streamed, so decoding resumes where the client
is and no token is sent twice. Past ``max_attempts`` the client gets UNAVAILABLE.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import redis

from gateway.job import Finished, Job, Retry, WorkerLost
from gateway.workers import WorkerDirectory, WorkerView
from splitserve.v1 import worker_pb2

log = logging.getLogger(__name__)

# Seconds a request may sit claimed before a reaper could hand it to someone else.
CLAIM_LEASE_S = 30.0
# Pause before claiming again when no decode worker had room, or no worker at all.
NO_ROOM_BACKOFF_S = 0.05
NO_WORKER_BACKOFF_S = 0.5
NO_ROOM_RECHECK_S = 0.25
# How often in-flight requests' workers are checked, and claim leases renewed.
WATCH_INTERVAL_S = 1.0
# A worker that failed a request is not picked again for this long (or until it answers a probe).
SUSPECT_S = 5.0
# Pause before a retry, times the attempt number: a restarting worker gets a moment.
RETRY_BACKOFF_S = 0.2
# Bound on the best-effort aborts of a failed attempt (the worker may be frozen).
ABORT_TIMEOUT_S = 1.0
# How long an admitted request waits for a usable set of workers to (re)appear before failing.
NO_WORKER_WAIT_S = 10.0
# How long a terminal state that Redis could not take is kept for another try.
UNRECORDED_KEEP_S = 600.0
# While Redis is away, how long a request waits to get back into the queue before failing.
REDIS_WAIT_S = 30.0


class Dispatcher:
    def __init__(self, state, directory: WorkerDirectory, gateway_id: str, max_concurrency: int = 256,
                 max_attempts: int = 3, on_retry=None):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.state = state
        self.directory = directory
        self.gateway_id = gateway_id
        self.max_attempts = max_attempts
        self.on_retry = on_retry  # called with the reason of each retry (metrics)
        self.jobs: dict[str, Job] = {}
        # Terminal states not yet written because Redis was away: id -> (state, fields, since).
        self._unrecorded: dict[str, tuple[str, dict, float]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        # Cleared when no decode worker had room; set when a request ends (pages come free).
        # Until then the claim loop only looks again every NO_ROOM_RECHECK_S, so requests
        # that cannot be placed wait in the queue instead of cycling through it.
        self._room = threading.Event()
        self._room.set()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="dispatch")
        self._thread = threading.Thread(target=self._claim_loop, name="claim-loop", daemon=True)
        self._watchdog = threading.Thread(target=self._watch_loop, name="watchdog", daemon=True)

    def start(self) -> "Dispatcher":
        self._thread.start()
        self._watchdog.start()
        return self

    def submit(self, job: Job) -> bool:
        """Track a job before it is admitted; False if a job with that id is already here."""
        with self._lock:
            if job.request_id in self.jobs:
                return False
            self.jobs[job.request_id] = job
        return True

    def wake(self) -> None:
        """A request was admitted: claim now rather than at the next poll."""
        self._wake.set()

    def cancel(self, request_id: str, finished: Finished | None = None) -> bool:
        """The client went away, its deadline passed or it asked to abort: stop the work, free
        every page, and end the stream with ``finished`` (default: aborted)."""
        with self._lock:
            job = self.jobs.get(request_id)
        if job is None or job.cancelled.is_set():
            return False
        job.cancelled.set()
        for call in list(job.calls):
            call.cancel()
        # Ends the client's stream even if the request never left the queue (the handler takes
        # the first Finished it sees, so one already on its way wins).
        self._end(job, finished or Finished("aborted", grpc.StatusCode.CANCELLED, "aborted"))
        self._abort_on_workers(job)
        return True

    def drain(self, timeout_s: float) -> None:
        """Wait (bounded) for the requests in flight to end; end the rest with UNAVAILABLE."""
        give_up = time.monotonic() + timeout_s
        while self.jobs and time.monotonic() < give_up:
            time.sleep(0.1)
        with self._lock:
            left = list(self.jobs.values())
        for job in left:
            log.warning("request %s still running at the end of the drain; ending it", job.request_id)
            self._end(job, Finished("error", grpc.StatusCode.UNAVAILABLE, "the gateway shut down before the "
                                    "request finished; retry it"))
            self.cancel(job.request_id)
        give_up = time.monotonic() + 5
        while self.jobs and time.monotonic() < give_up:  # their handlers record the end in Redis
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5)
        self._watchdog.join(5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- claiming --------------------------------------------------------------------
    def _claim_loop(self) -> None:
        while not self._stop.is_set():
            self._room.wait(NO_ROOM_RECHECK_S)
            try:
                self._wake.clear()  # before the claim: a request admitted from here on sets it again
                request_id = self.state.claim(self.gateway_id, CLAIM_LEASE_S, time.time())
                if request_id is None:
                    self._wake.wait(0.05)
                    continue
                with self._lock:
                    job = self.jobs.get(request_id)
                if job is None:  # its handler is gone (the client left, or an earlier life of this gateway)
                    self.record_end(request_id, "aborted", finish_reason="aborted",
                                    error="nobody is waiting for this request any more")
                    continue
            except redis.exceptions.RedisError as e:  # Redis down: keep trying; new requests get UNAVAILABLE
                log.warning("claim failed: %s", e)
                self._stop.wait(0.5)
                continue
            job.epoch, job.attempt, job.lost = request_id.epoch, request_id.attempt, None
            self._pool.submit(self._run, job)

    # ---- watching the workers under in-flight requests ------------------------------------
    def _watch_loop(self) -> None:
        last_renewal = time.monotonic()
        while not self._stop.wait(WATCH_INTERVAL_S):
            try:
                self._record_pending_ends()
                self._check_workers()
                if time.monotonic() - last_renewal > CLAIM_LEASE_S / 3:
                    self._renew_claims()
                    last_renewal = time.monotonic()
            except redis.exceptions.RedisError as e:  # the registry is in Redis: judge no one meanwhile
                log.warning("watchdog: request store unreachable: %s", e)
            except Exception:
                log.exception("watchdog failed")

    def _check_workers(self) -> None:
        """A worker gone from the registry (no heartbeat) that also ignores a direct health probe
        is dead or frozen: its requests' calls are cancelled and they are retried elsewhere.
        The probe keeps a Redis hiccup or a draining worker (deregistered, still finishing) safe."""
        with self._lock:
            busy = [j for j in self.jobs.values() if j.tracked and not j.lost and not j.cancelled.is_set()]
        if not busy:
            return
        registered = {w.worker_id for w in self.directory.list()}
        answers: dict[str, bool] = {}
        for job in busy:
            for worker in (job.prefill_worker, job.decode_worker):
                if worker is None or worker.worker_id not in job.tracked or worker.worker_id in registered:
                    continue
                if worker.worker_id not in answers:
                    answers[worker.worker_id] = self.directory.probe(worker) is not None
                if not answers[worker.worker_id]:
                    self._lose(job, f"{worker.role} worker {worker.worker_id} stopped heartbeating and does "
                                    "not answer")
                    break

    def _lose(self, job: Job, reason: str) -> None:
        job.lost = reason
        for call in list(job.calls):
            call.cancel()

    def _watch_call(self, job: Job, call):
        """Track an in-flight call so cancel and the watchdog can stop it (also if they already fired)."""
        job.calls.append(call)
        if job.lost or job.cancelled.is_set():
            call.cancel()
        return call

    def _renew_claims(self) -> None:
        """Keep this gateway's claims alive, and fail requests whose gateway stopped renewing
        (it died: nobody holds their client stream any more) so their records expire."""
        now = time.time()
        with self._lock:
            running = [j for j in self.jobs.values() if j.epoch]
        for job in running:
            self.state.extend_lease(job.request_id, job.epoch, CLAIM_LEASE_S, now)
        for request_id in self.state.inflight_expired(now, limit=64):
            if request_id not in self.jobs:
                log.warning("request %s: its gateway stopped renewing its claim; marking it failed", request_id)
                self.state.finish(request_id, None, "failed", finish_reason="error",
                                  error="the gateway holding this request went away")

    # ---- running one request -----------------------------------------------------------
    def _run(self, job: Job) -> None:
        try:
            outcome = self._attempt(job)
        except Exception as e:
            outcome = self._outcome_of(job, e)
            if not isinstance(outcome, Retry):
                # Ended here (error, cancel, deadline) after its workers took it on: free what
                # they hold now rather than at the lease's end. Aborts sent while a call was
                # still on its way may have missed; this one comes after every call returned.
                self._abort_on_workers(job, timeout=ABORT_TIMEOUT_S)
        finally:
            self._untrack(job)
        # Only after the workers are untracked: a requeued job may be claimed again at once.
        if isinstance(outcome, Retry):
            self._retry(job, outcome.reason)
        elif outcome == "requeue":
            self._room.clear()
            self._requeue(job)

    def _attempt(self, job: Job):
        """One try at the request: None when it ended (its Finished is queued), "requeue" when no
        decode worker had room. Worker failures raise."""
        if job.cancelled.is_set():
            return self._end(job, Finished("aborted", grpc.StatusCode.CANCELLED, "cancelled"))
        inputs = job.resume_inputs()
        if inputs is None:  # every token was out before the worker died
            return self._end(job, Finished("length"))
        candidates = self.directory.decode_candidates()
        if not any(w.role == "both" for w in candidates) and \
                (not candidates or self.directory.pick_prefill() is None):
            # Workers restarting (or re-registering after a Redis restart): wait for them, bounded.
            since = job.timeline.setdefault("no_worker_since", time.monotonic())
            if time.monotonic() - since < NO_WORKER_WAIT_S:
                return "requeue"
            return self._end(job, Finished("error", grpc.StatusCode.UNAVAILABLE, (
                f"no worker could serve this request for {NO_WORKER_WAIT_S:.0f} s: start a decode worker with "
                "a prefill worker, or a colocated one (splitserve decode --role both)")))
        job.timeline.pop("no_worker_since", None)
        placed = self._place(job, len(inputs[0]))
        if placed is None:
            return "requeue"
        worker, descriptor = placed
        if job.cancelled.is_set():  # cancelled while Reserve was on its way: its abort may have missed
            self._abort_on_workers(job, timeout=ABORT_TIMEOUT_S)
            return self._end(job, Finished("aborted", grpc.StatusCode.CANCELLED, "cancelled"))
        job.timeline.setdefault("dispatched", time.monotonic())
        self._update(job, state="prefilling", decode_worker=worker.worker_id)
        if worker.role == "both":
            self._run_colocated(job, worker, *inputs)
        else:
            self._run_disaggregated(job, worker, descriptor, *inputs)
        return None

    def _outcome_of(self, job: Job, exc: Exception):
        """What a failed attempt means: a Retry when a worker let the request down, else the end."""
        code = exc.code() if isinstance(exc, grpc.RpcError) else None
        # The deadline first: when it passes, the handler also cancels the job.
        if job.deadline is not None and (code == grpc.StatusCode.DEADLINE_EXCEEDED or job.deadline_passed()):
            return self._end(job, Finished("deadline", grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))
        if job.cancelled.is_set():
            return self._end(job, Finished("aborted", grpc.StatusCode.CANCELLED, "cancelled"))
        if job.lost:
            return Retry(job.lost)
        if isinstance(exc, WorkerLost):
            return Retry(str(exc))
        if isinstance(exc, grpc.FutureCancelledError) or code in (
                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
            # The worker went away, shut down under the call, or voided the handoff.
            return Retry(f"{code.name if code else 'CANCELLED'}: {exc.details() if code else exc}")
        if code is not None:
            return self._end(job, Finished("error", code, exc.details() or str(code)))
        log.error("request %s failed", job.request_id, exc_info=exc)
        return self._end(job, Finished("error", grpc.StatusCode.INTERNAL, f"gateway error: {exc}"))

    def _retry(self, job: Job, reason: str) -> None:
        log.warning("attempt %d of %s failed: %s", job.attempt, job.request_id, reason)
        if self.on_retry is not None:
            self.on_retry(reason)
        self._abort_on_workers(job, timeout=ABORT_TIMEOUT_S)
        for worker in (job.prefill_worker, job.decode_worker):
            if worker is not None and not self.directory.responsive(worker):
                self.directory.suspect(worker.worker_id, SUSPECT_S)
        if job.attempt >= self.max_attempts:
            return self._end(job, Finished("error", grpc.StatusCode.UNAVAILABLE,
                                           f"gave up after {job.attempt} attempts; last: {reason}"))
        time.sleep(RETRY_BACKOFF_S * job.attempt)
        self._requeue(job, epoch=job.epoch)

    def _requeue(self, job: Job, epoch: int | None = None) -> None:
        """Back in the queue in its old place; waits out a Redis outage (bounded)."""
        if epoch is None:
            time.sleep(NO_WORKER_BACKOFF_S if "no_worker_since" in job.timeline else NO_ROOM_BACKOFF_S)
        give_up = time.monotonic() + REDIS_WAIT_S
        while not job.cancelled.is_set() and not job.deadline_passed(0):
            try:
                if not self.state.requeue(job.request_id, epoch):
                    log.warning("request %s was not requeued (it ended meanwhile)", job.request_id)
                return
            except redis.exceptions.RedisError as e:
                if time.monotonic() > give_up:
                    return self._end(job, Finished("error", grpc.StatusCode.UNAVAILABLE,
                                                   f"request store (Redis) unreachable: {e}"))
                self._stop.wait(0.5)
        self._end(job, Finished("aborted", grpc.StatusCode.CANCELLED, "cancelled") if job.cancelled.is_set()
                  else Finished("deadline", grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))

    def _place(self, job: Job, num_prompt_tokens: int):
        """A decode worker with room: (worker, descriptor or None for a ``both`` worker)."""
        for worker in self.directory.decode_candidates():
            if worker.role == "both":
                self._track(job, worker, "decode_worker")
                return worker, None
            if self.directory.pick_prefill() is None:
                continue  # a decode-only worker needs a prefill worker beside it
            self._track(job, worker, "decode_worker")  # counted before the call: concurrent picks spread out
            try:
                response = self.directory.decode_stub(worker).Reserve(
                    worker_pb2.ReserveRequest(request_id=job.request_id,
                                              num_prompt_tokens=num_prompt_tokens),
                    timeout=self._timeout(job, 10.0))
            except grpc.RpcError as e:
                self._untrack_last(job)
                if e.code() == grpc.StatusCode.UNAVAILABLE and not self.directory.responsive(worker):
                    self.directory.suspect(worker.worker_id, SUSPECT_S)
                if e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
                    continue
                raise
            return worker, response.descriptor
        return None

    def _run_disaggregated(self, job: Job, decode: WorkerView, descriptor, prompt: list[int], sampling) -> None:
        prefill = self.directory.pick_prefill(prompt)  # _place checked that one exists
        if prefill is None:
            raise WorkerLost("no prefill worker left")
        self._track(job, prefill, "prefill_worker")
        future = self.directory.prefill_stub(prefill).Prefill.future(
            worker_pb2.PrefillRequest(request_id=job.request_id, prompt_token_ids=prompt,
                                      sampling=sampling, priority=job.priority, descriptor=descriptor),
            timeout=self._timeout(job, 120.0))
        first = self._watch_call(job, future).result()
        job.calls.remove(future)
        self.directory.affinity.record(self.directory.affinity.hashes(prompt), prefill.worker_id)
        job.timeline.setdefault("first_token", time.monotonic())
        job.timeline.setdefault("prefill_ms", first.prefill_ms)
        job.timeline.setdefault("kv_transfer_ms", first.kv_transfer_ms)
        if not job.generated:
            job.cached_prompt_tokens = first.cached_prompt_tokens
        job.emit([first.first_token], [first.first_logprobs] if first.HasField("first_logprobs") else [])
        self._update(job, state="decoding", prefill_worker=prefill.worker_id)
        request = worker_pb2.DecodeRequest(request_id=job.request_id, epoch=first.epoch,
                                           prompt_token_ids=prompt, sampling=sampling,
                                           priority=job.priority, first_token=first.first_token)
        if first.HasField("first_logprobs"):
            request.first_logprobs.CopyFrom(first.first_logprobs)
        if first.HasField("checksum"):
            request.checksum = first.checksum
        self._relay(job, self.directory.decode_stub(decode).Decode(request, timeout=self._timeout(job, None)))

    def _run_colocated(self, job: Job, worker: WorkerView, prompt: list[int], sampling) -> None:
        request = worker_pb2.DecodeRequest(request_id=job.request_id, prompt_token_ids=prompt,
                                           sampling=sampling, priority=job.priority)
        self._update(job, state="decoding")
        self._relay(job, self.directory.decode_stub(worker).Decode(request, timeout=self._timeout(job, None)))

    def _relay(self, job: Job, stream) -> None:
        for chunk in self._watch_call(job, stream):
            if chunk.token_ids:
                job.timeline.setdefault("first_token", time.monotonic())
                job.emit(list(chunk.token_ids), list(chunk.logprobs))
            if chunk.HasField("finish_reason"):
                return self._end(job, Finished(chunk.finish_reason))
        raise WorkerLost("the decode stream ended without a finish reason")

    def _end(self, job: Job, finished: Finished) -> None:
        job.timeline["finished"] = time.monotonic()
        job.events.put(finished)
        self._room.set()

    def _update(self, job: Job, **fields) -> None:
        """Progress notes in Redis are for GetRequest only: an outage must not fail the request."""
        try:
            self.state.update(job.request_id, job.epoch, **fields)
        except redis.exceptions.RedisError as e:
            log.warning("could not record the progress of %s: %s", job.request_id, e)

    # ---- bookkeeping -------------------------------------------------------------------
    def _timeout(self, job: Job, cap: float | None) -> float | None:
        remaining = job.remaining()
        if remaining is None:
            return cap
        return remaining if cap is None else min(cap, remaining)

    def _track(self, job: Job, worker: WorkerView, attr: str) -> None:
        setattr(job, attr, worker)
        job.tracked.append(worker.worker_id)
        self.directory.track(worker.worker_id, +1)

    def _untrack_last(self, job: Job) -> None:
        self.directory.track(job.tracked.pop(), -1)

    def _untrack(self, job: Job) -> None:
        while job.tracked:
            self.directory.track(job.tracked.pop(), -1)

    def _abort_on_workers(self, job: Job, timeout: float = 5.0) -> None:
        for worker, stub in ((job.prefill_worker, self.directory.prefill_stub),
                             (job.decode_worker, self.directory.decode_stub)):
            if worker is None:
                continue
            try:
                stub(worker).Abort(worker_pb2.WorkerAbortRequest(request_id=job.request_id), timeout=timeout)
            except grpc.RpcError as e:
                log.warning("abort of %s on %s failed: %s", job.request_id, worker.worker_id, e.code())

    def record_job_end(self, job: Job, state: str, **fields) -> None:
        """The one terminal write per job (the handler and the RPC-end callback may both try)."""
        if not job.recorded:
            job.recorded = True
            self.record_end(job.request_id, state, **fields)

    def record_end(self, request_id: str, state: str, **fields) -> None:
        """Write a request's terminal state; while Redis is away, keep it and write it once Redis
        is back (the watchdog retries), so no record is left live and no slot stays taken."""
        try:
            self.state.finish(request_id, None, state, **fields)
        except redis.exceptions.RedisError as e:
            log.warning("could not record the end of %s in Redis yet (%s); will retry", request_id, e)
            with self._lock:
                self._unrecorded[request_id] = (state, fields, time.monotonic())

    def _record_pending_ends(self) -> None:
        with self._lock:
            pending = list(self._unrecorded.items())
        for request_id, (state, fields, since) in pending:
            if time.monotonic() - since > UNRECORDED_KEEP_S:
                log.error("gave up recording the end of %s in Redis", request_id)
            else:
                self.state.finish(request_id, None, state, **fields)  # raises while Redis is still away
            with self._lock:
                self._unrecorded.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self.jobs.pop(request_id, None)
