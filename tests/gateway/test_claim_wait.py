"""The claim loop's sleep (``splitserve.gateway.claim._wait``) ends on a cancel even when its event is set
in the same instant: the gateway's stop() cancels the loop while wake messages keep coming, and
a swallowed cancel (``asyncio.wait_for`` on Python 3.11 does that) left stop() waiting forever."""
import asyncio

import pytest

from splitserve.gateway.claim import _wait


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


class _SwallowingPubSub:
    """A wake channel whose read loses every cancel, as redis-py's can when a cancel meets its
    read timeout (redis-py issue 2551)."""

    async def subscribe(self, channel):
        pass

    async def get_message(self, timeout):
        try:
            await asyncio.sleep(timeout)
        except asyncio.CancelledError:
            pass  # swallowed
        return None

    async def aclose(self):
        pass


class _State:
    wake_channel = "wake"

    class client:
        @staticmethod
        def pubsub(ignore_subscribe_messages):
            return _SwallowingPubSub()

    async def claim_many(self, *args, **kwargs):
        return []


def test_stop_ends_the_listener_even_when_its_reads_swallow_the_cancel():
    from splitserve.gateway.claim import ClaimLoop

    async def never_gated():
        return False

    async def main():
        loop = ClaimLoop(_State(), "gw", start_attempt=None, on_end_elsewhere=lambda rid: None,
                         needs_gate=never_gated).start()
        await asyncio.sleep(0.05)
        await asyncio.wait_for(loop.stop(), 5)  # the reads time out every second; the loop sees stop
        assert all(task.done() for task in loop._tasks)
    asyncio.run(main())
