"""Runs admitted requests on the workers: claim in priority order, reserve, prefill, decode, relay.

One claim loop per gateway takes the best queued request this gateway admitted (Redis holds
the order), then a pool thread runs it: a decode worker reserves pages, a prefill worker
writes the prompt's KV into them and returns the first token, the decode worker streams the
rest. A ``both`` worker does all of it itself. Tokens go to the request's ``Job.events``,
which the Generate handler streams to the client.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from gateway.workers import WorkerDirectory, WorkerView
from splitserve.v1 import generation_pb2, worker_pb2

log = logging.getLogger(__name__)

# Seconds a request may sit claimed before a reaper could hand it to someone else.
CLAIM_LEASE_S = 30.0
# Pause before claiming again when no decode worker had room.
NO_ROOM_BACKOFF_S = 0.05


@dataclass
class Tokens:
    token_ids: list[int]
    logprobs: list = field(default_factory=list)  # TokenLogprobs protos, one per token when asked


@dataclass
class Finished:
    finish_reason: str  # length | eos | stop | aborted | deadline | error
    status: grpc.StatusCode | None = None  # set when the request failed
    message: str = ""


@dataclass
class Job:
    request_id: str
    prompt_token_ids: list[int]
    sampling: generation_pb2.SamplingParams
    priority: int
    deadline: float | None  # time.monotonic() seconds, from the client's gRPC deadline
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    epoch: int = 0
    timeline: dict = field(default_factory=dict)
    prefill_worker: WorkerView | None = None
    decode_worker: WorkerView | None = None
    cached_prompt_tokens: int = 0
    calls: list = field(default_factory=list)  # in-flight gRPC calls, cancelled with the job

    def deadline_passed(self, slack_s: float = 0.25) -> bool:
        """True at (or just before) the deadline: the handler's clock starts a little after
        gRPC's, so an RPC that gRPC ends for its deadline can look a few ms early here."""
        return self.deadline is not None and time.monotonic() >= self.deadline - slack_s

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


class Dispatcher:
    def __init__(self, state, directory: WorkerDirectory, gateway_id: str, max_concurrency: int = 256):
        self.state = state
        self.directory = directory
        self.gateway_id = gateway_id
        self.jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="dispatch")
        self._thread = threading.Thread(target=self._claim_loop, name="claim-loop", daemon=True)

    def start(self) -> "Dispatcher":
        self._thread.start()
        return self

    def submit(self, job: Job) -> bool:
        """Track a job before it is admitted; False if a job with that id is already here."""
        with self._lock:
            if job.request_id in self.jobs:
                return False
            self.jobs[job.request_id] = job
        self._wake.set()
        return True

    def cancel(self, request_id: str) -> bool:
        """The client went away or asked to abort: stop the work and free every page."""
        with self._lock:
            job = self.jobs.get(request_id)
        if job is None or job.cancelled.is_set():
            return False
        job.cancelled.set()
        for call in list(job.calls):
            call.cancel()
        self._abort_on_workers(job)
        return True

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- claiming --------------------------------------------------------------------
    def _claim_loop(self) -> None:
        while not self._stop.is_set():
            try:
                request_id = self.state.claim(self.gateway_id, CLAIM_LEASE_S, time.time())
            except Exception:  # Redis down: keep trying; handlers report UNAVAILABLE meanwhile
                log.exception("claim failed")
                self._stop.wait(0.5)
                continue
            if request_id is None:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            with self._lock:
                job = self.jobs.get(request_id)
            if job is None:  # admitted by an earlier life of this gateway: nobody is listening
                self.state.finish(request_id, None, "aborted", finish_reason="aborted", error="gateway restarted")
                continue
            job.epoch = request_id.epoch
            self._pool.submit(self._run, job)

    # ---- running one request -----------------------------------------------------------
    def _run(self, job: Job) -> None:
        try:
            if job.cancelled.is_set():
                return self._end(job, Finished("aborted", grpc.StatusCode.CANCELLED, "cancelled"))
            candidates = self.directory.decode_candidates()
            if not any(w.role == "both" for w in candidates) and \
                    (not candidates or self.directory.pick_prefill() is None):
                return self._end(job, Finished("error", grpc.StatusCode.UNAVAILABLE,
                                               "no worker can serve this request: start a decode worker with a "
                                               "prefill worker, or a colocated one (splitserve decode --role both)"))
            placed = self._place(job)
            if placed is None:
                # No decode worker has room: back in the queue, in its place.
                self.state.requeue(job.request_id)
                time.sleep(NO_ROOM_BACKOFF_S)
                return
            worker, descriptor = placed
            job.timeline["dispatched"] = time.monotonic()
            self.state.update(job.request_id, job.epoch, state="prefilling", decode_worker=worker.worker_id)
            if worker.role == "both":
                self._run_colocated(job, worker)
            else:
                self._run_disaggregated(job, worker, descriptor)
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED or (job.deadline and job.remaining() == 0):
                self._end(job, Finished("deadline", grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))
            elif code == grpc.StatusCode.CANCELLED or job.cancelled.is_set():
                self._end(job, Finished("aborted", grpc.StatusCode.CANCELLED, "cancelled"))
            else:
                self._end(job, Finished("error", code, e.details() or str(code)))
        except Exception as e:
            log.exception("request %s failed", job.request_id)
            self._end(job, Finished("error", grpc.StatusCode.INTERNAL, f"gateway error: {e}"))
        finally:
            self._untrack(job)

    def _place(self, job: Job):
        """A decode worker with room: (worker, descriptor or None for a ``both`` worker)."""
        for worker in self.directory.decode_candidates():
            if worker.role == "both":
                self._track(job, worker, "decode_worker")
                return worker, None
            if self.directory.pick_prefill() is None:
                continue  # a decode-only worker needs a prefill worker beside it
            try:
                response = self.directory.decode_stub(worker).Reserve(
                    worker_pb2.ReserveRequest(request_id=job.request_id,
                                              num_prompt_tokens=len(job.prompt_token_ids)),
                    timeout=self._timeout(job, 10.0))
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
                    continue
                raise
            self._track(job, worker, "decode_worker")
            return worker, response.descriptor
        return None

    def _run_disaggregated(self, job: Job, decode: WorkerView, descriptor) -> None:
        prefill = self.directory.pick_prefill(job.prompt_token_ids)  # _place checked that one exists
        self._track(job, prefill, "prefill_worker")
        future = self.directory.prefill_stub(prefill).Prefill.future(
            worker_pb2.PrefillRequest(request_id=job.request_id, prompt_token_ids=job.prompt_token_ids,
                                      sampling=job.sampling, priority=job.priority, descriptor=descriptor),
            timeout=self._timeout(job, 120.0))
        job.calls.append(future)
        first = future.result()
        job.calls.remove(future)
        self.directory.affinity.record(self.directory.affinity.hashes(job.prompt_token_ids), prefill.worker_id)
        job.timeline["first_token"] = time.monotonic()
        job.timeline["prefill_ms"] = first.prefill_ms
        job.timeline["kv_transfer_ms"] = first.kv_transfer_ms
        job.cached_prompt_tokens = first.cached_prompt_tokens
        job.events.put(Tokens([first.first_token], [first.first_logprobs] if first.HasField("first_logprobs") else []))
        self.state.update(job.request_id, job.epoch, state="decoding", prefill_worker=prefill.worker_id)
        request = worker_pb2.DecodeRequest(request_id=job.request_id, epoch=first.epoch,
                                           prompt_token_ids=job.prompt_token_ids, sampling=job.sampling,
                                           priority=job.priority, first_token=first.first_token)
        if first.HasField("first_logprobs"):
            request.first_logprobs.CopyFrom(first.first_logprobs)
        if first.HasField("checksum"):
            request.checksum = first.checksum
        self._relay(job, self.directory.decode_stub(decode).Decode(request, timeout=self._timeout(job, None)))

    def _run_colocated(self, job: Job, worker: WorkerView) -> None:
        request = worker_pb2.DecodeRequest(request_id=job.request_id, prompt_token_ids=job.prompt_token_ids,
                                           sampling=job.sampling, priority=job.priority)
        self.state.update(job.request_id, job.epoch, state="decoding")
        self._relay(job, self.directory.decode_stub(worker).Decode(request, timeout=self._timeout(job, None)))

    def _relay(self, job: Job, stream) -> None:
        job.calls.append(stream)
        for chunk in stream:
            if chunk.token_ids:
                job.timeline.setdefault("first_token", time.monotonic())
                job.events.put(Tokens(list(chunk.token_ids), list(chunk.logprobs)))
            if chunk.HasField("finish_reason"):
                return self._end(job, Finished(chunk.finish_reason))
        raise RuntimeError("the decode stream ended without a finish reason")

    def _end(self, job: Job, finished: Finished) -> None:
        job.timeline["finished"] = time.monotonic()
        job.events.put(finished)

    # ---- bookkeeping -------------------------------------------------------------------
    def _timeout(self, job: Job, cap: float | None) -> float | None:
        remaining = job.remaining()
        if remaining is None:
            return cap
        return remaining if cap is None else min(cap, remaining)

    def _track(self, job: Job, worker: WorkerView, attr: str) -> None:
        setattr(job, attr, worker)
        self.directory.track(worker.worker_id, +1)

    def _untrack(self, job: Job) -> None:
        for worker in (job.prefill_worker, job.decode_worker):
            if worker is not None:
                self.directory.track(worker.worker_id, -1)

    def _abort_on_workers(self, job: Job) -> None:
        for worker, stub in ((job.prefill_worker, self.directory.prefill_stub),
                             (job.decode_worker, self.directory.decode_stub)):
            if worker is None:
                continue
            try:
                stub(worker).Abort(worker_pb2.WorkerAbortRequest(request_id=job.request_id), timeout=5)
            except grpc.RpcError as e:
                log.warning("abort of %s on %s failed: %s", job.request_id, worker.worker_id, e.code())

    def forget(self, request_id: str) -> None:
        with self._lock:
            self.jobs.pop(request_id, None)
