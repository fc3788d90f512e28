"""The ``n`` samples of one request (``sampling.n``), run as sibling jobs that share the prompt's KV.

Sample 0 is the request as admitted. Samples 1..n-1 are jobs of their own (ids ``<id>/1`` ...,
built on the request's scoped id, so no other identity can hold them first; each with its own
Redis record, retries and stop strings; with a seed, sample i samples with seed + i, as vLLM does), admitted once sample 0's decode worker has streamed to it (or sample 0
has ended): by then the prompt's KV sits in the prefix cache of the prefill worker that computed
it and of the decode worker that holds it. A sibling goes to that decode worker first (``Job.prefer_decode``), which
serves the prompt's full pages from its cache -- referenced, not copied
(``DecodeConnector.reserve``) -- so each sibling computes and moves only its prompt's last
partial page. Sample 0's admission asked the queue for room for all ``n``, so a sibling is never
refused for room.

The group ends when every sample has; the first sample that fails ends the others (CANCELLED)
and the client's call with its status, as an n > 1 request ends in vLLM.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Awaitable, Callable

from splitserve.engine.sampling_params import SamplingParams
from splitserve.gateway.job import Finished, Job, cancelled
from splitserve.gateway.outbox import Tokens
from splitserve.common.errors import SplitserveError

# Most samples one request may ask for (each is a job with its own place in the queue).
MAX_N = 16
SEED_MOD = 2 ** 64  # seeds are uint64


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample ``index``'s parameters: its own random stream, seed + index when seeded."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % SEED_MOD)


class SampleGroup:
    def __init__(self, leader: Job, n: int, admit_sample: Callable[[int, str | None], Awaitable[Job]],
                 request_id: str | None = None):
        """``admit_sample(i, prefer_decode)`` admits sample i (1..n-1), to be placed on the decode
        worker ``prefer_decode`` first, and returns its job; ``request_id``: the id the client
        knows the request by (default the leader's: ``splitserve.common.authz.scoped_id``)."""
        self.request_id = request_id or leader.request_id
        self.n = n
        self.jobs: list[Job | None] = [leader] + [None] * (n - 1)
        self._admit_sample = admit_sample
        self._watchers: list[Callable[[Job], None]] = []
        self._ready = asyncio.Event()
        self._join(leader)

    @property
    def leader(self) -> Job:
        return self.jobs[0]

    def started(self) -> list[Job]:
        return [job for job in self.jobs if job is not None]

    def finish(self, outcome: Finished) -> bool:
        """End every sample that has not ended (the client left, the call failed, Abort); True
        if there was one."""
        return any([job.finish(outcome) for job in self.started()])

    def watch(self, on_job: Callable[[Job], None]) -> None:
        """Call ``on_job`` with every sample's job, those started and those to come (the
        stream's bounds on unread output watch each)."""
        self._watchers.append(on_job)
        for job in self.started():
            on_job(job)

    def _join(self, job: Job) -> None:
        job.events.share_wakeup(self._ready)
        for on_job in self._watchers:
            on_job(job)

    async def events(self) -> AsyncIterator[tuple[int, Tokens | Finished]]:
        """``(index, Tokens)`` as they come and ``(index, Finished)`` as each sample ends, until
        all have ended -- or one failed: the others are ended then, and nothing follows."""
        live = {0}
        siblings_due = self.n > 1
        while live:
            self._ready.clear()  # before draining: whatever arrives from here on sets it again
            got_any = False
            for index in sorted(live):
                job = self.jobs[index]
                while True:
                    try:
                        event = job.events.get_nowait()
                    except asyncio.QueueEmpty:
                        break
                    got_any = True
                    if isinstance(event, Finished):
                        live.discard(index)
                    yield index, event
                    if isinstance(event, Finished):
                        if event.status is not None:
                            self.finish(cancelled(f"sample {index} of this request failed: {event.message}"))
                            return
                        break
            if siblings_due and (self.leader.decoding or self.leader.finished):
                siblings_due = False
                async for index, failure in self._admit_siblings(live):
                    yield index, failure
                    return
                continue
            if not got_any:
                await self._ready.wait()

    async def _admit_siblings(self, live: set[int]) -> AsyncIterator[tuple[int, Finished]]:
        """Admit samples 1..n-1 where sample 0's prompt KV now sits; yields the one failure, if any."""
        decode = self.leader.decode_worker
        for index in range(1, self.n):
            try:
                job = await self._admit_sample(index, decode.worker_id if decode is not None else None)
            except SplitserveError as e:
                self.finish(cancelled(f"sample {index} of this request could not start: {e}"))
                yield index, Finished("error", e.code, f"sample {index}: {e}")
                return
            self.jobs[index] = job
            self._join(job)
            live.add(index)
