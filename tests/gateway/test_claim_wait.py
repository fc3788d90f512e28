"""The claim loop's sleep (``gateway.claim._wait``) ends on a cancel even when its event is set
in the same instant: the gateway's stop() cancels the loop while wake messages keep coming, and
a swallowed cancel (``asyncio.wait_for`` on Python 3.11 does that) left stop() waiting forever."""
import asyncio

import pytest

from gateway.claim import _wait


def test_a_cancel_that_meets_a_wake_up_still_cancels():
    async def main():
        event = asyncio.Event()
        sleeper = asyncio.get_running_loop().create_task(_wait(event, 30))
        await asyncio.sleep(0)  # the sleeper now waits on the event
        event.set()
        sleeper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sleeper
    asyncio.run(main())


def test_the_wait_returns_on_the_event_or_the_timeout():
    async def main():
        event = asyncio.Event()
        await _wait(event, 0.01)  # times out quietly
        event.set()
        await asyncio.wait_for(_wait(event, 30), 1)
    asyncio.run(main())
