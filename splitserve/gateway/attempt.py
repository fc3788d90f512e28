"""One try at a request on workers: place it, prefill, decode, relay the tokens.

**Placing** chooses a decode worker with room and reserves pages for the prompt on it
(``DecodeWorker.Reserve``); a colocated (``both``) worker needs no reservation, its engine
queues the request, and neither does a decode worker that prefills the prompt itself
(``--disaggregation``, splitserve/gateway/prefill_placement.py). **Running** sends the prompt
and the pages' descriptor to a prefill worker, which writes the KV straight into them and
returns the first token (streamed to the client at once); the decode worker then completes the
handoff with the epoch and streams the rest. While the prefill is under way the attempt renews
the reservation's lease, so a prompt that waits or computes longer than one lease keeps its
pages; the lease only frees pages nobody drives.

``run_attempt`` returns what the dispatcher has to do next: nothing (``None``: the request
ended, its job is finished), ``Requeue`` (no room, or no usable workers yet: back in the
queue in its old place) or ``Retry`` (a worker died, froze or voided the handoff: costs one
attempt). Whatever ends an attempt early, it frees what the request holds on its workers.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

import grpc

from splitserve.gateway.job import Finished, Job, JobState, deadline_exceeded, unavailable
from splitserve.gateway.ledger import OUTAGE, Ledger
from splitserve.gateway.prefill_placement import PlacementInputs, PrefillPlacement
from splitserve.gateway.prefix_routing import CachedRun
from splitserve.gateway.workers import WorkerDirectory, WorkerView
from splitserve.common.aio import spawn
from splitserve.wire import sampling_to_worker
from splitserve.v1 import worker_pb2

log = logging.getLogger(__name__)

# Bounds on the calls of an attempt (a request's own deadline shortens them).
RESERVE_TIMEOUT_S = 5.0
PREFILL_TIMEOUT_S = 120.0
# Bound on the aborts a failed attempt waits for before its retry (the worker may be frozen).
ABORT_TIMEOUT_S = 1.0
# Bound on the aborts of an ended request, which nothing waits for: a worker busy for longer
# than ABORT_TIMEOUT_S must still get its Abort, or the request's pages stay held until the lease ends.
ENDED_ABORT_TIMEOUT_S = 30.0
# Renew a reservation's lease this many times per lease while its prefill is under way: a late
# or lost renewal still leaves time for the next.
RENEWALS_PER_LEASE = 3
# A worker that failed a request and a probe, or a Reserve, is not picked again for this long
# (longer than a worker's heartbeat lives: by then a dead or frozen one has left the registry).
SUSPECT_S = 5.0
# How long an admitted request waits for a usable set of workers to (re)appear before failing.
NO_WORKER_WAIT_S = 10.0
# Pause before a request that found no room / no workers is put back in the queue.
NO_ROOM_BACKOFF_S = 0.05
NO_WORKER_BACKOFF_S = 0.5


@dataclass
class Requeue:
    no_room: bool  # no decode worker had room (else: no usable set of workers yet)


@dataclass
class Retry:
    reason: str


class WorkerLost(Exception):
    """A worker under the request died, froze or voided the handoff: worth another attempt."""


class _NoWorkers(Exception):
    pass


class _NoRoom(Exception):
    pass


async def run_attempt(job: Job, directory: WorkerDirectory, ledger: Ledger, decided: asyncio.Future):
    """One attempt of ``job`` (it was just claimed). ``decided`` gets a result once the placement
    is decided, so the dispatcher can claim the next request: True to claim on at once, False
    when no room (or no workers) was found and claims should wait for capacity."""
    attempt = _Attempt(job, directory, ledger)
    gate: asyncio.Task | None = None  # the placement gate's opening, once placed (or failed to)
    try:
        try:
            placed_ok = await attempt.place()
        except (_NoRoom, _NoWorkers):
            decide(decided, False)  # the gate stays closed until the requeue: nobody passes it
            raise
        except BaseException:
            gate = spawn(_open_gate(job, ledger, decided), name=f"gate-{job.request_id}")
            raise
        # The placement gate opens beside the prefill: only the dispatcher's next claim waits for it.
        gate = spawn(_open_gate(job, ledger, decided), name=f"gate-{job.request_id}")
        if not placed_ok:
            return None
        job.state = JobState.RUNNING
        await attempt.run()
        return None
    except asyncio.CancelledError:
        if job.lost is None:  # ended by Job.finish (client gone, stop string, abort, drain...)
            spawn(attempt.abort_on_workers(ENDED_ABORT_TIMEOUT_S))  # nothing waits for it
            raise
        asyncio.current_task().uncancel()  # the watchdog's signal: this attempt is lost, not the job
        outcome = Retry(job.lost)
    except _NoRoom:
        return Requeue(no_room=True)
    except _NoWorkers:
        since = job.timeline.setdefault("no_worker_since", time.monotonic())
        if time.monotonic() - since < NO_WORKER_WAIT_S:
            return Requeue(no_room=False)
        job.finish(unavailable(f"no worker could serve this request for {NO_WORKER_WAIT_S:.0f} s: start a decode "
                               "worker with a prefill worker, or a colocated one (splitserve decode --role both)"))
        return None
    except Exception as exc:
        outcome = attempt.outcome_of(exc)
    finally:
        attempt.release_load()
        if not job.finished:
            # Off its workers: the watchdog judges (and cancels) RUNNING attempts only, so its
            # verdict on the worker this attempt just left cannot cancel the cleanup, the backoff
            # or the requeue below (that lost the request for good: nobody put it back).
            job.state = JobState.QUEUED
    # Ended early (a retry, an error): free what it holds now rather than at the lease's end. A
    # retry may reserve on the same worker again, so no abort of this attempt may outlive this
    # wait; an ended request's that timed out goes on in the background. Shielded: the request
    # may end while they are sent (the client's deadline passing as the worker call it capped
    # did), and Job.finish cancels this task then; the aborts must go out all the same. (They
    # were cancelled before they left, and the decode worker kept a reservation until its lease
    # ended: a cancel storm found 9 pages so.) Only Job.finish can cancel this wait: the
    # watchdog judges RUNNING attempts, and a finished request is not retried.
    aborts = attempt.abort_on_workers(then_s=None if isinstance(outcome, Retry) else ENDED_ABORT_TIMEOUT_S)
    await asyncio.shield(spawn(aborts, name=f"attempt-aborts-{job.request_id}"))
    if isinstance(outcome, Retry):
        for worker in attempt.workers:
            if not await directory.responsive(worker):
                directory.suspect(worker.worker_id, SUSPECT_S)
        if gate is not None:
            # Before the requeue closes the gate again for the next attempt: this attempt's
            # opening (or a retry of it by the Redis client) must not land after that and open it.
            await asyncio.wait([gate])
        return outcome
    job.finish(outcome)
    return None


async def _open_gate(job: Job, ledger: Ledger, decided: asyncio.Future) -> None:
    """Open the placement gate ``job`` passed, then let the dispatcher claim on."""
    try:
        if job.gated:
            await ledger.placed(job.request_id)
    finally:
        decide(decided, True)


def decide(future: asyncio.Future, value: bool) -> None:
    if not future.done():
        future.set_result(value)


class _Attempt:
    def __init__(self, job: Job, directory: WorkerDirectory, ledger: Ledger):
        self.job = job
        self.directory = directory
        self.ledger = ledger
        self.workers: list[WorkerView] = []  # may hold something for the request; counted in their load
        self.descriptor = None
        self.lease_ttl_s = 0.0  # of the reservation (0: the worker does not say; nothing to renew)
        self.prompt: list[int] = []
        self.sampling = None
        # The decode worker prefilling the prompt itself, until its first token (its local prefills' count).
        self.local_prefill: WorkerView | None = None

    # ---- placing ------------------------------------------------------------------------
    async def place(self) -> bool:
        """Choose the decode worker and reserve its pages; False if nothing is left to generate
        (every token was out before the last worker died: the job is finished)."""
        job = self.job
        job.prefill_worker = job.decode_worker = None
        inputs = job.resume_inputs()
        if inputs is None:
            job.finish(Finished("length"))
            return False
        self.prompt, params = inputs
        self.sampling = sampling_to_worker(params)
        candidates, cached = await self.directory.placement_candidates(params.lora, self.prompt)
        if job.prefer_decode is not None:  # stable: the others keep their order by load
            candidates.sort(key=lambda w: w.worker_id != job.prefer_decode)
        if not job.gated:  # claimed without the gate: only a placement that takes no capacity
            candidates = [w for w in candidates if w.role == "both"]
        # A decode-only worker needs a prefill worker beside it, unless it may prefill itself.
        decode_alone = (await self.directory.pick_prefill(lora=params.lora) is not None
                        or not self.directory.prefill_policy.needs_prefill_workers)
        if not any(w.role == "both" for w in candidates) and not (candidates and decode_alone):
            raise _NoWorkers()
        job.timeline.pop("no_worker_since", None)
        for worker in candidates:
            if worker.role != "both" and not decode_alone:
                continue
            self._track(worker)  # counted before the call: concurrent picks spread out
            if worker.role == "both":
                job.decode_worker = worker
                return True
            placement = await self._where_to_prefill(worker, cached.get(worker.worker_id), params.lora)
            if placement.local:
                job.decode_worker = self.local_prefill = worker
                prefills = self.directory.local_prefills
                prefills[worker.worker_id] = prefills.get(worker.worker_id, 0) + 1
                self._placed(placement)
                return True
            try:
                with job.trace.call("reserve", worker.worker_id, job.attempt) as metadata:
                    response = await self.directory.decode_stub(worker).Reserve(
                        self._reserve_request(),
                        timeout=job.timeout(RESERVE_TIMEOUT_S), metadata=metadata)
            except grpc.RpcError as e:
                # A Reserve that timed out may still run when a frozen worker wakes up: the worker
                # stays on the attempt's list, whose end aborts the request there.
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    self._untrack(worker)
                await self._reserve_failed(worker, e)
                continue  # no room there, or it refuses new work (draining): the next one
            job.decode_worker = worker
            self.descriptor = response.descriptor
            self.lease_ttl_s = response.lease_ttl_s
            # What the decode worker holds, as it says (the directory's figure is a hint, or unread).
            held = min(response.descriptor.num_cached_blocks * self.directory.block_size, len(self.prompt))
            self._placed(dataclasses.replace(placement, uncached_tokens=len(self.prompt) - held))
            return True
        raise _NoRoom()

    async def _where_to_prefill(self, decode: WorkerView, cached: CachedRun | None, lora: str | None
                                ) -> PrefillPlacement:
        policy = self.directory.prefill_policy
        queue = await self.directory.prefill_queue(decode, lora) if policy.disaggregation == "auto" else None
        return policy.decide(PlacementInputs(
            prompt_tokens=len(self.prompt), cached_tokens=cached.blocks * self.directory.block_size if cached else 0,
            step_prompt_budget=decode.step_prompt_budget, prefill_queue=queue,
            local_prefills=self.directory.local_prefills.get(decode.worker_id, 0)))

    def _placed(self, placement: PrefillPlacement) -> None:
        """The decision this attempt goes with: its metric and its trace attributes."""
        self.directory.on_prefill_placement(placement)
        self.job.trace.annotate({"splitserve.prefill_placement": placement.where,
                                 "splitserve.prefill_placement_reason": placement.reason,
                                 "splitserve.uncached_prompt_tokens": placement.uncached_tokens})

    def _reserve_request(self) -> worker_pb2.ReserveRequest:
        # With the prompt, the worker serves its head from its prefix cache: a shared prefix (the
        # other samples of an n > 1 request, a system prompt) crosses once. With the constraint,
        # it compiles the grammar while the prompt is prefilled. Not under a LoRA adapter: the
        # reservation's prefix match is the base model's, whose KV an adapter must not reuse.
        request = worker_pb2.ReserveRequest(request_id=self.job.request_id, num_prompt_tokens=len(self.prompt),
                                            prompt_token_ids=self.prompt if not self.sampling.lora else ())
        if self.sampling.HasField("structured_output"):
            request.structured_output.CopyFrom(self.sampling.structured_output)
        return request

    async def _reserve_failed(self, worker: WorkerView, error: grpc.RpcError) -> None:
        """A Reserve that failed: returns when the next candidate may be asked, raises when the
        attempt is over. A worker that timed out, or died (no answer to a probe), is dead, frozen
        or wedged: it is suspected (picked for nothing a while, so the next attempt goes
        elsewhere) and the attempt is lost, as when a worker dies under a running request. One
        that refuses new work (draining) is only skipped."""
        code = error.code()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and self.job.deadline_passed():
            raise error  # the client's own deadline
        if code not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
            raise error
        alive = code == grpc.StatusCode.UNAVAILABLE and await self.directory.probe(worker) is not None
        self.directory.suspect(worker.worker_id, SUSPECT_S)
        if not alive:
            raise WorkerLost(f"decode worker {worker.worker_id} failed Reserve ({code.name}: {error.details()})")

    # ---- running ------------------------------------------------------------------------
    async def run(self) -> None:
        job = self.job
        job.timeline.setdefault("dispatched", time.monotonic())
        decode = job.decode_worker
        colocated = decode.role == "both" or self.local_prefill is not None  # the whole request there
        # Progress for GetRequest, beside the worker call (not a Redis round trip before it).
        self.ledger.note_soon(job.request_id, job.epoch, state="decoding" if colocated else "prefilling",
                              decode_worker=decode.worker_id)
        if colocated:
            request = worker_pb2.DecodeRequest(request_id=job.request_id, prompt_token_ids=self.prompt,
                                               sampling=self.sampling, priority=job.priority,
                                               arrival_time=job.arrival_s)
            with job.trace.call("decode", decode.worker_id, job.attempt) as metadata:
                return await self._relay(self.directory.decode_stub(decode).Decode(
                    request, timeout=job.timeout(None), metadata=metadata))
        prefill = await self.directory.pick_prefill(self.prompt, decode, self.sampling.lora or None)
        if prefill is None:
            raise WorkerLost("no prefill worker left")
        self._track(prefill)
        job.prefill_worker = prefill
        renewer = spawn(self._keep_lease(decode), name=f"lease-{job.request_id}")
        try:
            with job.trace.call("prefill", prefill.worker_id, job.attempt) as metadata:
                first = await self.directory.prefill_stub(prefill).Prefill(
                    worker_pb2.PrefillRequest(request_id=job.request_id, prompt_token_ids=self.prompt,
                                              sampling=self.sampling, priority=job.priority,
                                              descriptor=self.descriptor, arrival_time=job.arrival_s),
                    timeout=job.timeout(PREFILL_TIMEOUT_S), metadata=metadata)
        finally:
            renewer.cancel()
        job.timeline.setdefault("prefill_ms", first.prefill_ms)
        job.timeline.setdefault("kv_transfer_ms", first.kv_transfer_ms)
        if not job.generated:
            job.cached_prompt_tokens = first.cached_prompt_tokens
        job.emit([first.first_token], [first.first_logprobs] if first.HasField("first_logprobs") else [])
        # Beside the decode call, as at the start: the second token must not wait for Redis.
        self.ledger.note_soon(job.request_id, job.epoch, state="decoding", prefill_worker=prefill.worker_id)
        request = worker_pb2.DecodeRequest(request_id=job.request_id, epoch=first.epoch, prompt_token_ids=self.prompt,
                                           sampling=self.sampling, priority=job.priority, first_token=first.first_token,
                                           arrival_time=job.arrival_s, sampler_state=first.sampler_state)
        if first.HasField("first_logprobs"):
            request.first_logprobs.CopyFrom(first.first_logprobs)
        if first.HasField("checksum"):
            request.checksum = first.checksum
        with job.trace.call("decode", decode.worker_id, job.attempt) as metadata:
            await self._relay(self.directory.decode_stub(decode).Decode(request, timeout=job.timeout(None),
                                                                        metadata=metadata))

    async def _keep_lease(self, decode: WorkerView) -> None:
        """Renew the reservation's lease on ``decode`` until cancelled (the prefill returned). A
        failed renewal is only logged: a frozen or dead worker is the watchdog's to judge, and a
        lease that is gone voids the handoff, which the prefill reports at its next write."""
        if self.lease_ttl_s <= 0:
            return
        interval = self.lease_ttl_s / RENEWALS_PER_LEASE
        stub = self.directory.decode_stub(decode)
        request = worker_pb2.RenewLeaseRequest(request_id=self.job.request_id, epoch=self.descriptor.epoch)
        while True:
            await asyncio.sleep(interval)
            try:
                await stub.RenewLease(request, timeout=interval)
            except grpc.RpcError as e:
                log.warning("lease renewal of %s on %s failed: %s %s", self.job.request_id, decode.worker_id,
                            e.code(), e.details())

    async def _relay(self, call) -> None:
        try:
            async for chunk in call:
                self.job.decoding = True
                self._local_prefill_over()
                if chunk.cached_prompt_tokens and not self.job.generated:
                    self.job.cached_prompt_tokens = chunk.cached_prompt_tokens
                if chunk.token_ids:
                    self.job.emit(list(chunk.token_ids), list(chunk.logprobs))
                    if self.job.finished:  # a stop string matched here: the worker must stop too
                        call.cancel()  # (Job.finish cannot cancel this task: it runs in it)
                        return
                if chunk.HasField("finish_reason"):
                    self.job.finish(Finished(chunk.finish_reason))
                    return
        except BaseException:
            call.cancel()
            raise
        raise WorkerLost("the decode stream ended without a finish reason")

    # ---- how it went ----------------------------------------------------------------------
    def outcome_of(self, exc: Exception) -> Retry | Finished:
        """What a failed attempt means: a Retry when a worker let the request down, else the end."""
        job = self.job
        code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
        # DEADLINE_EXCEEDED is the client's only when the client's own deadline passed: a call
        # the gateway capped itself (Reserve, Prefill) or a worker's own timeout says the worker
        # is slow or stuck, which another attempt may fix.
        if job.deadline_passed():
            return deadline_exceeded()
        if isinstance(exc, WorkerLost):
            return Retry(str(exc))
        if isinstance(exc, OUTAGE):
            # Redis went away under the placement (the registry's read): no fault of the request.
            # Another attempt starts once the requeue, which waits for Redis, has put it back.
            return Retry(f"request store (Redis) unreachable: {exc}")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
            # The worker went away, shut down under the call, voided the handoff or timed out.
            return Retry(f"{code.name}: {exc.details()}")
        if code is not None:
            return Finished("error", code, exc.details() or str(code))
        log.error("request %s failed", job.request_id, exc_info=exc)
        return Finished("error", grpc.StatusCode.INTERNAL, f"gateway error: {exc}")

    # ---- bookkeeping -------------------------------------------------------------------
    def _track(self, worker: WorkerView) -> None:
        self.workers.append(worker)
        self.directory.track(worker.worker_id, +1)

    def _untrack(self, worker: WorkerView) -> None:
        self.workers.remove(worker)
        self.directory.track(worker.worker_id, -1)

    def release_load(self) -> None:
        """The attempt is over: its workers no longer count it (they stay listed for aborts)."""
        self._local_prefill_over()
        for worker in self.workers:
            self.directory.track(worker.worker_id, -1)

    def _local_prefill_over(self) -> None:
        """The decode worker prefilling the prompt is done with it (first token, or the attempt's end)."""
        if self.local_prefill is not None:
            self.directory.local_prefills[self.local_prefill.worker_id] -= 1
            self.local_prefill = None

    async def abort_on_workers(self, timeout_s: float | None = None, then_s: float | None = None) -> None:
        """Free whatever the request holds on the attempt's workers, waiting ``timeout_s`` at most
        (default ABORT_TIMEOUT_S: one may be frozen). ``then_s``: an abort that timed out is sent
        again in the background, bounded so."""
        async def abort(worker: WorkerView, timeout_s: float, again: bool) -> None:
            stub = (self.directory.prefill_stub if worker.role == "prefill" else self.directory.decode_stub)(worker)
            try:
                await stub.Abort(worker_pb2.WorkerAbortRequest(request_id=self.job.request_id), timeout=timeout_s)
            except grpc.RpcError as e:
                log.warning("abort of %s on %s failed: %s", self.job.request_id, worker.worker_id, e.code())
                if again and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    spawn(abort(worker, then_s, again=False))
        first_s = ABORT_TIMEOUT_S if timeout_s is None else timeout_s
        await asyncio.gather(*(abort(w, first_s, then_s is not None) for w in self.workers))
