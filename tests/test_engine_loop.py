"""The worker's engine loop: which commands still run after their caller stopped waiting.

A command queued behind a long step may outlast its caller's timeout. An ordinary one is then
dropped (nobody wants its answer), but a release must still happen: the gateway's Abort waits
1 s, and an Abort dropped so kept a reservation's pages held until its lease ended.
"""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from splitserve.v1 import worker_pb2
from splitserve.worker.engine_loop import EngineDead, EngineLoop
from splitserve.worker.servicer import WorkerServicer


class _Stepper:
    """A step that blocks until told to go on: the loop thread is busy for as long as a test likes."""

    def __init__(self):
        self.entered = threading.Event()
        self.go_on = threading.Event()
        self.pending = True

    def step(self):
        self.entered.set()
        self.go_on.wait(30)
        self.pending = False
        return []

    def has_work(self) -> bool:
        return self.pending


def _run_after_timeout(loop: EngineLoop, stepper: _Stepper, must_run: bool) -> list[str]:
    ran: list[str] = []

    async def caller():
        with pytest.raises(asyncio.TimeoutError):
            await loop.run(lambda: ran.append("ran"), timeout=0.05, must_run=must_run)

    assert stepper.entered.wait(10)
    asyncio.run(caller())
    stepper.go_on.set()
    loop.call(lambda: None)  # every command queued before this one has had its turn
    return ran


@pytest.mark.parametrize("must_run", [False, True])
def test_a_command_whose_caller_timed_out_runs_only_when_it_must(must_run):
    stepper = _Stepper()
    loop = EngineLoop(stepper.step, stepper.has_work).start()
    try:
        assert _run_after_timeout(loop, stepper, must_run) == (["ran"] if must_run else [])
    finally:
        loop.stop()


class _BusyWorker(WorkerServicer):
    """A worker whose one step takes as long as the test likes; ``abort`` records what it freed."""
    role = "decode"

    def __init__(self, stepper: _Stepper, **engine_fields):
        self.stepper = stepper
        self.aborted: list[str] = []
        engine = SimpleNamespace(grammars=SimpleNamespace(), config=SimpleNamespace(grammar_compile_timeout_s=1.0),
                                 **engine_fields)
        super().__init__(engine, "busy-worker", [])

    def step(self):
        return self.stepper.step()

    def has_work(self) -> bool:
        return self.stepper.has_work()

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True


def test_an_abort_whose_caller_gave_up_during_a_long_step_still_frees_the_request():
    stepper = _Stepper()
    worker = _BusyWorker(stepper)
    try:
        assert stepper.entered.wait(10)

        async def gateway():  # its Abort waits a bounded time: the worker may be frozen
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(worker.Abort(worker_pb2.WorkerAbortRequest(request_id="r1"), None), 0.05)

        asyncio.run(gateway())
        assert worker.aborted == []  # the step is still going
        stepper.go_on.set()
        deadline = time.monotonic() + 10
        while not worker.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.aborted == ["r1"]
    finally:
        stepper.go_on.set()
        worker.close()


def test_the_engine_niceness_and_thread_binding_apply_to_a_cpu_engine_of_one_rank_only():
    import torch
    from splitserve.worker.servicer import applied_niceness, cpu_engine_of_one_rank

    def engine(device: str, ranks: int = 1):
        return SimpleNamespace(runner=SimpleNamespace(device=torch.device(device)),
                               config=SimpleNamespace(tensor_parallel_size=ranks))
    assert applied_niceness(engine("cpu"), 5) == 5
    assert applied_niceness(engine("cpu"), 0) == 0
    assert applied_niceness(engine("cpu", ranks=2), 5) == 0  # the other ranks would wait on rank 0
    assert applied_niceness(engine("cuda"), 5) == 0  # its thread launches the kernels
    assert cpu_engine_of_one_rank(engine("cpu"))
    assert not cpu_engine_of_one_rank(engine("cpu", ranks=2)) and not cpu_engine_of_one_rank(engine("cuda"))


class _Forward(_Stepper):
    """A step whose middle lets go of the loop's state lock, as an engine's forward does."""

    def __init__(self):
        super().__init__()
        self.loop: EngineLoop | None = None

    def step(self):
        self.loop.state_lock.release()
        try:
            return super().step()
        finally:
            self.loop.state_lock.acquire()


def test_a_call_during_a_step_runs_inside_its_forward_and_not_before():
    forward, held = _Forward(), _Stepper()
    forward.loop = EngineLoop(forward.step, forward.has_work)
    forward.loop.start()
    held_loop = EngineLoop(held.step, held.has_work).start()  # a step that keeps the lock throughout
    try:
        assert forward.entered.wait(10) and held.entered.wait(10)

        async def calls():
            # the loop thread is inside a forward: the call runs now, the step still going on
            during = await asyncio.wait_for(forward.loop.run_during_step(lambda: forward.pending), 10)
            late = asyncio.ensure_future(held_loop.run_during_step(lambda: held.pending))
            await asyncio.sleep(0.2)
            assert not late.done()  # the loop thread holds the lock: the call waits for the step's end
            held.go_on.set()
            return during, await asyncio.wait_for(late, 10)
        assert asyncio.run(calls()) == (True, False)
    finally:
        forward.go_on.set()
        held.go_on.set()
        forward.loop.stop()
        held_loop.stop()


def test_a_call_during_a_step_finishes_before_its_cancelled_caller_hears_of_it():
    stepper = _Stepper()
    loop = EngineLoop(stepper.step, stepper.has_work).start()
    ran: list[str] = []
    try:
        assert stepper.entered.wait(10)

        async def caller():
            task = asyncio.ensure_future(loop.run_during_step(lambda: ran.append("reserved")))
            await asyncio.sleep(0.05)
            task.cancel()  # while the call waits for the lock: it still runs, and first
            await asyncio.sleep(0.05)
            task.cancel()  # a second cancel does not end the wait either
            await asyncio.sleep(0.05)
            assert not task.done() and ran == []
            stepper.go_on.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            return list(ran)
        assert asyncio.run(caller()) == ["reserved"]
    finally:
        stepper.go_on.set()
        loop.stop()


def test_a_call_during_a_step_comes_after_the_commands_queued_before_it():
    """An Abort queued behind a long step, then a Reserve of the same id (a retry): the Reserve
    waits for the Abort, though the step lets go of the lock, so it does not find the old pages."""
    forward = _Forward()
    forward.loop = EngineLoop(forward.step, forward.has_work)
    forward.loop.start()
    order: list[str] = []
    try:
        assert forward.entered.wait(10)

        async def calls():
            forward.loop.submit(lambda: order.append("abort"))
            reserve = asyncio.ensure_future(forward.loop.run_during_step(lambda: order.append("reserve")))
            await asyncio.sleep(0.2)
            assert order == []  # the abort waits for the step's end, and the reserve for the abort
            forward.go_on.set()
            await asyncio.wait_for(reserve, 10)
        asyncio.run(calls())
        assert order == ["abort", "reserve"]
    finally:
        forward.go_on.set()
        forward.loop.stop()


class _Failing(_Stepper):
    def step(self):
        super().step()
        raise RuntimeError("the step failed")


@pytest.mark.parametrize("end", ["the step fails", "the loop stops"])
def test_a_call_waiting_beside_a_loop_that_fails_or_stops_never_runs(end):
    stepper = _Failing() if end == "the step fails" else _Stepper()
    loop = EngineLoop(stepper.step, stepper.has_work).start()
    ran: list[str] = []
    try:
        assert stepper.entered.wait(10)

        async def call():
            waiting = asyncio.ensure_future(loop.run_during_step(lambda: ran.append("reserved")))
            await asyncio.sleep(0.05)
            assert loop.beside_calls == 1  # a draining worker waits for it
            if end == "the loop stops":
                threading.Thread(target=loop.stop).start()
                while not loop._stop.is_set():  # stopping before the step ends and lets go of the lock
                    await asyncio.sleep(0.01)
            stepper.go_on.set()
            with pytest.raises(EngineDead):
                await asyncio.wait_for(waiting, 10)
            with pytest.raises(EngineDead):  # and no later one is taken
                await loop.run_during_step(lambda: ran.append("later"))
        asyncio.run(call())
        assert ran == [] and loop.beside_calls == 0
    finally:
        stepper.go_on.set()
        loop.stop()


def test_a_worker_hands_its_loop_lock_to_the_engine():
    stepper = _Stepper()
    worker = _BusyWorker(stepper, state_lock=None)
    try:
        assert worker.engine.state_lock is worker.loop.state_lock
    finally:
        stepper.go_on.set()
        worker.close()


def test_a_step_that_does_not_end_is_reported_once_with_where_it_is(monkeypatch, caplog):
    monkeypatch.setenv("SPLITSERVE_ENGINE_STALL_WARN_S", "0.2")
    stepper = _Stepper()
    loop = EngineLoop(stepper.step, stepper.has_work).start()
    try:
        with caplog.at_level("WARNING", logger="splitserve.worker.engine_loop"):
            assert stepper.entered.wait(10)
            assert not loop.report_stall()  # under the bound
            time.sleep(0.3)
            assert loop.report_stall()
            assert not loop.report_stall()  # the same round is not reported twice
            stepper.go_on.set()
            loop.call(lambda: None)
        [record] = caplog.records
        assert "busy for" in record.getMessage() and "in step" in record.getMessage()  # the step's own frame
    finally:
        loop.stop()


def test_a_loop_waiting_for_work_is_not_a_stall(monkeypatch, caplog):
    monkeypatch.setenv("SPLITSERVE_ENGINE_STALL_WARN_S", "0.2")
    stepper = _Stepper()
    stepper.pending = False  # nothing to do: the loop sleeps on its command queue
    loop = EngineLoop(stepper.step, stepper.has_work).start()
    try:
        with caplog.at_level("WARNING", logger="splitserve.worker.engine_loop"):
            time.sleep(1.0)
            assert not loop.report_stall()
            assert loop.call(lambda: "ran") == "ran"
        assert not caplog.records
    finally:
        loop.stop()
