"""The Ledger's writes of one request land in the order they were made. Its Redis is a stand-in
inside this test of the one class: a ``finish`` that waits until the test lets it through, to
hold the first write back as a slow connection would (each write takes its own connection from
redis-py's pool, so without the order a later one could reach Redis first)."""
import asyncio

from splitserve.gateway.ledger import Ledger


class HeldState:
    """``finish`` as Redis's: the first terminal state written wins; the first call waits for ``release``."""

    def __init__(self):
        self.release = asyncio.Event()
        self.calls = 0
        self.states: dict[str, str] = {}

    async def finish(self, request_id, epoch, state, **fields):
        self.calls += 1
        if self.calls == 1:
            await self.release.wait()
        self.states.setdefault(request_id, state)
        return self.states[request_id] == state


def test_the_first_end_made_is_the_one_kept_even_when_its_write_is_slow():
    async def main():
        state = HeldState()
        ledger = Ledger(state)
        ledger.record_end("r1", "deadline", finish_reason="deadline", error="deadline exceeded")
        ledger.record_end("r1", "aborted", finish_reason="aborted", error="nobody is waiting for this request any more")
        ledger.record_end("r2", "finished", finish_reason="length")  # another request does not wait
        await asyncio.sleep(0.05)
        assert state.states == {"r2": "finished"}  # r1's second end waits behind its first
        state.release.set()
        await ledger.flush(5)
        assert state.states == {"r1": "deadline", "r2": "finished"}
        assert not ledger._writes and not ledger._ends
    asyncio.run(main())
