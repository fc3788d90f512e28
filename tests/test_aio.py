"""``splitserve.common.aio.wait_for``: a cancel is never lost, and nothing in the package uses
``asyncio.wait_for`` (which loses one on Python 3.11). ``cancel_and_wait``, bounded, does not
wait for ever on a task that swallows its cancel."""
import ast
import asyncio
from pathlib import Path

import pytest

from splitserve.common.aio import cancel_and_wait, wait_for

PACKAGE = Path(__file__).resolve().parents[1] / "splitserve"


async def _beating(ready: asyncio.Future, result: list[asyncio.Future]) -> None:
    """A loop like a heartbeat: wait (bounded) for an answer, then go round again."""
    while True:
        answer = asyncio.get_running_loop().create_future()
        result.append(answer)
        if not ready.done():
            ready.set_result(None)
        await wait_for(answer, 10)
        await asyncio.sleep(0)


def test_a_cancel_that_lands_as_the_answer_arrives_ends_the_loop():
    """The answer is set and the task cancelled in the same turn of the event loop: the race
    that ``asyncio.wait_for`` on 3.11 settles by returning the answer and dropping the cancel."""
    async def main():
        ready, answers = asyncio.get_running_loop().create_future(), []
        task = asyncio.create_task(_beating(ready, answers))
        await ready
        await asyncio.sleep(0)  # the task now waits in wait_for
        answers[-1].set_result("stats")
        task.cancel()  # once: cancel_and_wait would cancel again, and hide a lost cancel
        await asyncio.wait([task], timeout=5)
        return task.done() and task.cancelled()  # before asyncio.run's teardown cancels what is left
    assert asyncio.run(main()), "the cancel was lost: the loop went round again"


def test_a_timeout_is_a_timeout_error_and_a_prompt_answer_is_returned():
    async def main():
        with pytest.raises(TimeoutError):
            await wait_for(asyncio.sleep(10), 0.05)
        assert await wait_for(asyncio.sleep(0, "now"), 5) == "now"
        assert await wait_for(asyncio.sleep(0, "unbounded"), None) == "unbounded"
    asyncio.run(main())


def test_the_package_never_calls_asyncio_wait_for():
    calls = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "wait_for" and \
                    isinstance(node.value, ast.Name) and node.value.id == "asyncio":
                calls.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not calls, f"use splitserve.common.aio.wait_for (it says why): {calls}"


def test_a_task_that_swallows_its_cancel_is_logged_with_its_stack_and_left(caplog):
    """A bounded cancel_and_wait goes on without a task that will not end (a shutdown step must
    not wait for ever on a heartbeat); an unbounded one is not asked here: it would wait."""
    async def stubborn(started: asyncio.Event, release: asyncio.Event) -> None:
        started.set()
        while not release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass  # as a library that retries on any error would

    async def polite() -> None:
        await asyncio.sleep(10)

    async def main():
        started, release = asyncio.Event(), asyncio.Event()
        stuck, ends = asyncio.create_task(stubborn(started, release), name="stubborn"), asyncio.create_task(polite())
        await started.wait()
        await cancel_and_wait(stuck, ends, None, timeout_s=0.2)
        assert ends.cancelled() and not stuck.done()
        release.set()
        await stuck
    with caplog.at_level("ERROR", logger="splitserve.common.aio"):
        asyncio.run(main())
    [record] = caplog.records
    assert "stubborn still runs 0.2 s after it was cancelled" in record.getMessage()
    assert "in stubborn" in record.getMessage()  # where it was
