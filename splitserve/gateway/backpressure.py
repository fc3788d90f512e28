"""Bounds on the output a gateway holds for clients that do not read their streams.

gRPC's HTTP/2 flow control stops a stream's sender once the client's window is full: a client
that never reads leaves the gateway's Generate handler waiting in its send, while the workers
keep producing the request's tokens into its ``Outbox``. Measured before these bounds (tiny model,
clients with a 1 KiB window): a stream's send blocked after ~40 messages, the request ran to its
end all the same (holding its pages on the decode worker), the rest of its 1,000 tokens stayed
at the gateway, and the handler with everything it held stayed as long as the client's
connection (or deadline) did.

``Backpressure`` bounds that three ways (``splitserve.common.limits.OutputLimits``, each a gateway flag):

* **per stream**: past ``max_buffered_tokens_per_stream`` tokens waiting, the request ends;
* **per gateway**: while all outboxes together hold more than ``max_buffered_bytes``, new
  Generate calls are refused with RESOURCE_EXHAUSTED and a retry hint (the streams holding it
  are cut by the timeout, so the gateway recovers by itself);
* **slow readers**: a message that waits more than ``slow_reader_timeout_s`` for its client ends
  the request.

A cut request ends through ``Job.finish`` (RESOURCE_EXHAUSTED, the reason as its message), which
aborts it on its workers and frees its pages like any other end; then the RPC is ended with that
status and its handler, stuck in its send, is cancelled. The client reads the status after the
messages already in its window (it cannot get it earlier: HTTP/2 sends trailers after data).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc

from splitserve.gateway.job import Finished, Job
from splitserve.gateway.outbox import Outbox
from splitserve.common.aio import cancel_and_wait, spawn
from splitserve.common.errors import ResourceExhausted
from splitserve.common.limits import OutputLimits

log = logging.getLogger(__name__)

# Retry hint of a Generate refused because the gateway holds too much unread output: the slow
# readers holding it are cut within one timeout, most streams drain much sooner.
RETRY_AFTER_S = 1.0
# Longest pause between two checks for stalled sends (shorter timeouts check more often).
CHECK_EVERY_S = 1.0


class Stream:
    """One Generate stream as ``Backpressure`` watches it."""

    def __init__(self, owner: "Backpressure", job: Job, context, task: asyncio.Task | None):
        """``context``: the gRPC call's (its status is sent at a cut); None for an HTTP stream."""
        self.owner = owner
        self.job = job
        self.context = context
        self.task = task  # the handler's task, cancelled when a cut finds it stuck in a send
        self.sending_since: float | None = None  # monotonic time the message being sent was handed to gRPC
        self.cut_reason: str | None = None

    def changed(self, outbox: Outbox, tokens: int, nbytes: int) -> None:
        """The outbox observer: keeps the gateway's total, cuts a stream past its own bound."""
        self.owner.buffered_bytes += nbytes
        limit = self.owner.limits.max_buffered_tokens_per_stream
        if tokens > 0 and outbox.tokens > limit and self.cut_reason is None:
            # Not from here: this runs in the attempt's task, which the cut has to cancel.
            asyncio.get_running_loop().call_soon(
                self.cut, f"{outbox.tokens} generated tokens waited for a client that did not read its stream, "
                          f"more than this server keeps for one stream (--max-buffered-tokens-per-stream {limit})")

    def stalled_for(self, now: float) -> float:
        return 0.0 if self.sending_since is None else now - self.sending_since

    def cut(self, reason: str) -> None:
        """End the request (its pages are freed on its workers) and the RPC, with RESOURCE_EXHAUSTED."""
        if self.cut_reason is not None:
            return
        self.cut_reason = reason
        self.owner.cuts += 1
        if self.owner.on_cut is not None:
            self.owner.on_cut()
        log.warning("%s: cutting a slow reader: %s", self.job.request_id, reason)
        self.job.finish(Finished("aborted", ResourceExhausted.code, reason))
        self.job.events.discard()  # nobody will read them
        if self.sending_since is not None and self.task is not None:
            # The handler waits in a send that only the client can complete: the status goes out
            # behind the data already sent (the abort waits until the client reads or leaves),
            # and the handler stops waiting now. (An HTTP stream has no status to send after its
            # 200: its connection is closed.)
            if self.context is not None:
                spawn(_abort(self.context, reason), name=f"abort-{self.job.request_id}")
            self.task.cancel()


async def _abort(context, reason: str) -> None:
    try:
        await context.abort(ResourceExhausted.code, reason)
    except grpc.aio.AbortError:
        pass  # the status was sent: that is how abort returns
    except Exception as e:  # gRPC refused the status (the call's headers were still pending)
        log.warning("could not end a slow reader's stream with a status (%s); it ends at the client's "
                    "deadline or disconnection", e)


class Backpressure:
    """The gateway's bounds on unread output (see the module doc)."""

    def __init__(self, limits: OutputLimits = OutputLimits(), on_cut: Callable[[], None] | None = None):
        self.limits = limits
        self.on_cut = on_cut  # called at each cut (metrics)
        self.buffered_bytes = 0  # in every open stream's outbox
        self.streams: set[Stream] = set()
        self.cuts = 0  # streams cut so far
        self._task: asyncio.Task | None = None

    def check_room(self) -> None:
        """Raise RESOURCE_EXHAUSTED while the gateway holds more unread output than allowed."""
        if self.buffered_bytes > self.limits.max_buffered_bytes:
            raise ResourceExhausted(
                f"this gateway holds {self.buffered_bytes / 2**20:.1f} MiB of output its clients have not read, "
                f"more than it keeps (--max-buffered-bytes {self.limits.max_buffered_bytes}); retry later",
                retry_after_s=RETRY_AFTER_S)

    def open(self, job: Job, context) -> Stream:
        stream = Stream(self, job, context, asyncio.current_task())
        job.events.observer = stream
        self.streams.add(stream)
        return stream

    def close(self, stream: Stream) -> None:
        self.streams.discard(stream)
        stream.job.events.discard()
        stream.job.events.observer = None

    # ---- slow readers ------------------------------------------------------------------------
    def cut_stalled(self, now: float | None = None) -> int:
        """Cut every stream whose message has waited past the timeout; returns how many."""
        now = time.monotonic() if now is None else now
        timeout = self.limits.slow_reader_timeout_s
        stalled = [s for s in self.streams if s.cut_reason is None and s.stalled_for(now) > timeout]
        for stream in stalled:
            stream.cut(f"the client did not read its stream for {timeout:g} s (--slow-reader-timeout-s)")
        return len(stalled)

    def start(self) -> "Backpressure":
        self._task = spawn(self._watch(), name="slow-readers")
        return self

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _watch(self) -> None:
        every = min(CHECK_EVERY_S, self.limits.slow_reader_timeout_s / 4)
        while True:
            await asyncio.sleep(every)
            self.cut_stalled()
