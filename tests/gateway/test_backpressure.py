"""The gateway's bounds on unread output, one class at a time (no process: a job driven by hand,
a stand-in for the gRPC context). The same bounds against real processes and a client that never
reads: tests/faults/test_slow_readers.py."""
import asyncio

import grpc
import pytest

from splitserve.gateway.backpressure import Backpressure
from splitserve.gateway.job import Finished, Job, Tokens
from splitserve.gateway.outbox import TOKEN_BYTES, Outbox
from splitserve.common.errors import ResourceExhausted
from splitserve.common.limits import OutputLimits
from tests.gateway.test_job import make_job


class Recorder:
    def __init__(self):
        self.changes = []

    def changed(self, outbox, tokens, nbytes):
        self.changes.append((tokens, nbytes))


def test_tokens_that_wait_are_merged_and_taken_at_once():
    box, seen = Outbox(), Recorder()
    box.observer = seen
    box.put_nowait(Tokens([1, 2], [], "ab"))
    box.put_nowait(Tokens([3], [], "c"))
    box.put_nowait(Finished("length"))
    assert (box.tokens, box.nbytes) == (3, 3 * TOKEN_BYTES + 3)
    first = box.get_nowait()
    assert (first.token_ids, first.text) == ([1, 2, 3], "abc") and (box.tokens, box.nbytes) == (0, 0)
    assert box.get_nowait() == Finished("length") and box.empty()
    with pytest.raises(asyncio.QueueEmpty):
        box.get_nowait()
    assert seen.changes == [(2, 2 * TOKEN_BYTES + 2), (1, TOKEN_BYTES + 1), (-3, -(3 * TOKEN_BYTES + 3))]


def test_get_waits_for_output():
    async def main():
        box = Outbox()
        getter = asyncio.get_running_loop().create_task(box.get())
        await asyncio.sleep(0.01)
        assert not getter.done()
        box.put_nowait(Tokens([7], [], "x"))
        assert (await asyncio.wait_for(getter, 1)).token_ids == [7]
    asyncio.run(main())


class Context:
    """Stand-in for grpc.aio's ServicerContext: records the status it is aborted with."""

    def __init__(self):
        self.aborted = None

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise grpc.aio.AbortError()


async def _stuck_handler(backpressure: Backpressure, job: Job, context: Context, opened: asyncio.Event):
    """A Generate handler whose client does not read: its send never completes."""
    stream = backpressure.open(job, context)
    try:
        stream.sending_since = asyncio.get_running_loop().time()
        opened.set()
        await asyncio.Event().wait()
    finally:
        backpressure.close(stream)


def _run_stuck(limits: OutputLimits, body):
    async def main():
        backpressure, context, opened, ended = Backpressure(limits), Context(), asyncio.Event(), []
        job = make_job(ended, max_tokens=100, text=False)
        handler = asyncio.get_running_loop().create_task(_stuck_handler(backpressure, job, context, opened))
        await opened.wait()
        await body(backpressure, job, handler)
        await asyncio.wait_for(asyncio.gather(handler, return_exceptions=True), 5)
        await asyncio.sleep(0.01)  # the spawned abort
        return backpressure, job, handler, context, ended
    return asyncio.run(main())


def test_a_stream_past_its_token_bound_is_cut():
    async def body(backpressure, job, handler):
        job.emit(list(range(10)), [])
        await asyncio.sleep(0.01)
        assert not job.finished and backpressure.buffered_bytes == 10 * TOKEN_BYTES
        job.emit([10], [])  # the 11th waiting token
    backpressure, job, handler, context, ended = _run_stuck(OutputLimits(max_buffered_tokens_per_stream=10), body)
    assert job.outcome.status == grpc.StatusCode.RESOURCE_EXHAUSTED and job.outcome.terminal_state == "aborted"
    assert "--max-buffered-tokens-per-stream 10" in job.outcome.message and ended == [job]
    assert handler.cancelled() and context.aborted == (grpc.StatusCode.RESOURCE_EXHAUSTED, job.outcome.message)
    assert backpressure.buffered_bytes == 0 and not backpressure.streams and backpressure.cuts == 1


def test_a_send_that_waits_past_the_timeout_is_cut_and_a_reading_stream_is_not():
    async def body(backpressure, job, handler):
        reader = make_job([], text=False)
        reading = backpressure.open(reader, Context())  # waits for output, not for its client
        job.emit([1, 2, 3], [])
        now = asyncio.get_running_loop().time()
        assert backpressure.cut_stalled(now + 1.9) == 0
        assert backpressure.cut_stalled(now + 2.1) == 1
        assert not reader.finished and reading.cut_reason is None
        backpressure.close(reading)
    backpressure, job, handler, context, ended = _run_stuck(OutputLimits(slow_reader_timeout_s=2.0), body)
    assert job.outcome == Finished("aborted", grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   "the client did not read its stream for 2 s (--slow-reader-timeout-s)")
    assert handler.cancelled() and context.aborted[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert backpressure.buffered_bytes == 0 and not backpressure.streams


def test_new_requests_are_refused_while_the_gateway_holds_too_much_unread_output():
    async def body(backpressure, job, handler):
        backpressure.check_room()
        job.emit(list(range(3)), [])  # 108 bytes: past the bound of 100
        with pytest.raises(ResourceExhausted) as refused:
            backpressure.check_room()
        assert refused.value.retry_after_s > 0 and "--max-buffered-bytes 100" in str(refused.value)
        backpressure.cut_stalled(asyncio.get_running_loop().time() + 10)
    backpressure, *_ = _run_stuck(OutputLimits(max_buffered_bytes=100, slow_reader_timeout_s=1.0), body)
    backpressure.check_room()  # the cut freed it


@pytest.mark.parametrize("field", ["max_buffered_tokens_per_stream", "max_buffered_bytes", "slow_reader_timeout_s"])
def test_output_limits_must_be_positive(field):
    with pytest.raises(ValueError, match=f"{field} must be > 0"):
        OutputLimits(**{field: 0})
