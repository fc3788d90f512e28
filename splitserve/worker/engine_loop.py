"""One thread owns a worker's engine; the asyncio gRPC handlers talk to it through this loop.

The engine and the kvtransfer connectors are not thread-safe, and an engine step blocks for
milliseconds to seconds, so it cannot run on the event loop either. Handlers hand closures to
the loop thread (``await loop.run(fn)``: run between steps, result or exception handed back;
``loop.submit(fn)``: fire and forget) and read per-request events from ``subscribe``, an
``asyncio.Queue`` the loop thread fills with ``call_soon_threadsafe``.

A step's forward reads its plan (its requests and their page lists), not the rest of the engine's
bookkeeping: free pages, the prefix cache's unreferenced ones, other owners. The loop thread holds ``state_lock`` whenever it touches the engine, and the engine lets go of it
while a step's forward computes (``LLMEngine.state_lock``). ``await loop.run_during_step(fn)`` runs
``fn`` on a thread of its own under that lock: between steps, or while a forward computes. A decode
worker's page reservation goes that way: it had waited for the step under way to end before the
prefill could start (half a decode step of every first token, on average; 19-28 ms of a
disaggregated request's queueing on 2 cores, against 1.5-1.9 ms colocated). The loop steps while
there is work and otherwise sleeps on its command queue, so an idle worker burns no CPU.

The loop thread can run at a lower CPU priority than the rest of the process (``niceness``, the
worker's ``--engine-niceness``); the torch threads it starts inherit it. Where the gateway, Redis
and the workers share a few cores, a step's compute fills them, and every hop of a request (the
gateway's admission, its Redis call, the worker's gRPC handler, a token's relay) waited for a core:
under ``vllm bench serve`` at 2 req/s on 2 cores a request reached the worker's handler 10.2-10.8 ms
after the gateway had it, 6.9 ms with the engine's threads at nice 5. Those hops are short, so the steps lose
little; on a box with cores to spare nothing changes. (Nice values rank the threads of one session
or cgroup; while the loop thread holds the GIL, the handlers still wait for it, as before.)
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from splitserve.engine.openmp import ComputeHandover
from splitserve.common.aio import wait_for
from splitserve.common.errors import Unavailable

log = logging.getLogger(__name__)

Step = Callable[[], list[tuple[str, Any]]]  # one engine step -> (request_id, event) pairs

# Fault injection for the reliability tests: the N-th engine step raises (0: never).
FAIL_STEP_ENV = "SPLITSERVE_FAULT_FAIL_STEP"
# ... and every engine step takes this many seconds longer (0: no delay): a prefill as slow as
# a long prompt on a small machine, with a tiny model, so a test can outlast a lease for sure.
SLOW_STEP_ENV = "SPLITSERVE_FAULT_STEP_DELAY_S"

# The loop thread busy this long in one go (a step, the commands between steps, housekeeping) is
# reported once, with where it is: a step that never ends holds its requests and their pages where
# they are, and nothing else in the process says why. 0: no report.
STALL_WARN_ENV = "SPLITSERVE_ENGINE_STALL_WARN_S"
DEFAULT_STALL_WARN_S = 30.0


class EngineDead(Unavailable):
    """The engine loop stopped after a failed step; the worker must be restarted (its callers
    get UNAVAILABLE, so a gateway retries the request on another worker)."""


class EngineLoop:
    def __init__(self, step: Step, has_work: Callable[[], bool], housekeeping: Callable[[], None] | None = None,
                 housekeeping_interval_s: float = 0.5, name: str = "engine-loop", niceness: int = 0,
                 bind_threads: bool = False):
        """``niceness``: added to the loop thread's nice value (and so its torch threads'); 0: none.
        ``bind_threads``: bind the loop thread's torch threads one a core, where it has one for
        each core (splitserve/engine/openmp.py, ``bind_thread_team``)."""
        fail_at = int(os.environ.get(FAIL_STEP_ENV, "0") or 0)
        delay_s = float(os.environ.get(SLOW_STEP_ENV, "0") or 0)
        step = _slowed(step, delay_s) if delay_s > 0 else step
        self._step = _failing_at(step, fail_at) if fail_at > 0 else step
        self._has_work = has_work
        self._housekeeping = housekeeping
        self._interval = housekeeping_interval_s
        self.niceness = niceness
        self.bind_threads = bind_threads
        self.bound_cores: list[int] = []  # where the loop thread's torch threads were bound, in order
        self._commands: queue.Queue = queue.Queue()
        # request id -> how to hand it an event (put on a queue.Queue, or onto an event loop).
        self._subscribers: dict[str, Callable[[Any], None]] = {}
        self._lock = threading.Lock()
        # Held by the loop thread while it runs commands, steps or keeps house; the engine lets go of
        # it while a step's forward computes (the engine's ``state_lock`` is this lock).
        self.state_lock = threading.Lock()
        # run_during_step's thread: one, as the lock lets only one such call in at a time anyway.
        self._beside = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-beside")
        # Commands queued so far, and taken off the queue (run, or failed): a call beside a step
        # waits for the commands queued before it (an Abort before a retried Reserve of the same id).
        self._queued = self._taken = 0
        self._queue_lock = threading.Lock()
        self._taken_cond = threading.Condition(self.state_lock)
        self.beside_calls = 0  # run_during_step calls not finished (a draining worker waits for them)
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stall_warn_s = float(os.environ.get(STALL_WARN_ENV, "") or DEFAULT_STALL_WARN_S)
        # When the loop thread's current round of work began (None while it waits for work), and
        # the round last reported as a stall.
        self._busy_since: float | None = None
        self._stall_reported: float | None = None

    def start(self) -> "EngineLoop":
        # The engine was built on this thread; from now on the loop thread computes (splitserve/engine/openmp.py).
        self._handover = ComputeHandover()
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def report_stall(self) -> bool:
        """Log, once per round, a round of the loop thread's work (a step, the commands between
        steps, housekeeping) that has gone on for longer than the stall bound, with where the loop
        thread is now; True when it logged. For whoever watches the loop: the worker's serve loop
        calls it with its liveness check (a thread of the loop's own would count among the
        threads an engine starts, which the thread-placement tests check one by one)."""
        since = self._busy_since
        if self._stall_warn_s <= 0 or since is None or since == self._stall_reported \
                or time.monotonic() - since < self._stall_warn_s:
            return False
        self._stall_reported = since
        frame = sys._current_frames().get(self._thread.ident)
        where = "".join(traceback.format_stack(frame)) if frame is not None else "(its frame is gone)\n"
        log.warning("the engine thread has been busy for %.1f s in one go (a step, the commands between steps "
                    "or housekeeping); it is at:\n%s", time.monotonic() - since, where.rstrip())
        return True

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Queue ``fn`` for the loop thread; returns a concurrent future of its result."""
        if not self.alive:
            raise EngineDead(f"the engine loop has stopped: {self.error!r}")
        future: Future = Future()
        with self._queue_lock:
            self._queued += 1
            self._commands.put((fn, future))
        return future

    def call(self, fn: Callable[[], Any], timeout: float | None = 60.0) -> Any:
        """Run ``fn`` on the loop thread and wait for its result (from a thread, not the event loop)."""
        return self.submit(fn).result(timeout=timeout)

    async def run(self, fn: Callable[[], Any], timeout: float | None = 60.0, *, must_run: bool = False) -> Any:
        """Run ``fn`` on the loop thread and await its result. A caller cancelled (or timed out)
        before the loop thread got to ``fn`` cancels it: it never runs -- unless ``must_run``:
        a release (an Abort) must happen whether or not its caller still waits for the answer,
        or what it frees stays held (a busy loop thread outlasted the gateway's 1 s Abort, and a
        cancel storm kept a reservation's pages until its lease ended)."""
        future = asyncio.wrap_future(self.submit(fn))
        if must_run:
            future.add_done_callback(_retrieved)  # nobody may be left to read its error
            future = asyncio.shield(future)
        return await wait_for(future, timeout)

    async def run_during_step(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` under ``state_lock`` on a thread of its own and await its result: at once
        when the loop thread is idle or inside a step's forward, else as soon as it gets there,
        and after every command queued before this call (their order is kept). Only for ``fn``
        that changes nothing a forward reads (no running request, no page of one): the forward
        runs on beside it. Unlike ``run``, ``fn`` runs even if the caller is cancelled first; the
        caller's ``CancelledError`` comes after ``fn`` has finished, so what the caller does about
        it (free what ``fn`` took) comes after it too. A loop that has failed or stopped runs no
        more such calls: they raise ``EngineDead``."""
        if self._ended() or not self._thread.is_alive():
            raise EngineDead(f"the engine loop has stopped: {self.error!r}")
        with self._queue_lock:
            ticket = self._queued

        def locked() -> Any:
            with self._taken_cond:
                self._taken_cond.wait_for(lambda: self._taken >= ticket or self._ended())
                if self._ended():
                    raise EngineDead(f"the engine loop has stopped: {self.error!r}")
                return fn()
        try:
            call = self._beside.submit(locked)
        except RuntimeError:  # stopped meanwhile (its executor shut down)
            raise EngineDead("the engine loop has stopped") from None
        with self._queue_lock:
            self.beside_calls += 1
        call.add_done_callback(self._beside_done)
        future = asyncio.wrap_future(call)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            while not future.done():  # a second cancel must not end the wait either
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([future])
            if not future.cancelled():
                future.exception()  # retrieved: nobody else will read it
            raise

    def _beside_done(self, _call: Future) -> None:
        with self._queue_lock:
            self.beside_calls -= 1

    def _ended(self) -> bool:
        return self.error is not None or self._stop.is_set()

    def subscribe(self, request_id: str) -> asyncio.Queue:
        """Events for ``request_id`` from now on, on the calling event loop; call before the
        request can produce any."""
        events: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()

        def put(event: Any) -> None:
            try:
                aloop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop closed under us: nobody is listening
                pass
        with self._lock:
            self._subscribers[request_id] = put
        return events

    def subscribe_sync(self, request_id: str) -> queue.Queue:
        """``subscribe`` for a caller on a plain thread (benchmarks drive the engine that way)."""
        events: queue.Queue = queue.Queue()
        with self._lock:
            self._subscribers[request_id] = events.put
        return events

    def unsubscribe(self, request_id: str) -> None:
        with self._lock:
            self._subscribers.pop(request_id, None)

    def fail(self, error: BaseException) -> None:
        """The engine is gone from outside the loop (a tensor-parallel rank died while the worker
        was idle): mark the loop dead and fail every waiter, as a failed step does."""
        if self.error is None:
            log.error("engine failed outside a step: %s", error)
            self.error = error
            self._fail_everyone(error)
            self._commands.put(None)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)
        # Once the loop thread is gone no call beside it can be under way: waited for, so the
        # engine is closed after it. A wedged loop thread may still hold the lock: not waited for.
        self._beside.shutdown(wait=not self._thread.is_alive(), cancel_futures=True)

    # ---- the thread ------------------------------------------------------------------
    def _run(self) -> None:
        lower_thread_priority(self.niceness)  # before adopt(): the torch threads it starts inherit it
        self.bound_cores = self._handover.adopt(bind=self.bind_threads)
        if self.bound_cores:
            log.info("engine threads bound one a core: %s", self.bound_cores)
        next_housekeeping = time.monotonic()
        try:
            while not self._stop.is_set():
                with self._busy(), self._holding():
                    idle = not self._has_work()
                first = self._next_command(block=idle)  # waited for without the lock
                with self._busy(), self._holding():
                    self._run_commands(first)
                    if self._stop.is_set():
                        break
                    if self._has_work():
                        self._publish(self._step())
                    if self._housekeeping and time.monotonic() >= next_housekeeping:
                        self._housekeeping()
                        next_housekeeping = time.monotonic() + self._interval
        except BaseException as e:  # a failed step kills the worker: every waiter hears it
            log.exception("engine loop failed")
            self.error = e
            self._fail_everyone(e)
        finally:
            with self._taken_cond:  # calls waiting beside: the loop has ended
                self._taken_cond.notify_all()

    @contextlib.contextmanager
    def _busy(self):
        """A round of the loop thread's work, for ``report_stall`` (taking the lock counts too)."""
        self._busy_since = time.monotonic()
        try:
            yield
        finally:
            self._busy_since = None

    @contextlib.contextmanager
    def _holding(self):
        """``state_lock``, a failure under it recorded before it is let go: a call waiting beside
        then sees the engine dead instead of running on it."""
        with self.state_lock:
            try:
                yield
            except BaseException as e:
                self.error = e
                raise

    def _next_command(self, block: bool) -> Any:
        """The next command (None: stop), or _NO_COMMAND when there is none (after the housekeeping
        interval when ``block``)."""
        try:
            return self._commands.get(timeout=self._interval) if block else self._commands.get_nowait()
        except queue.Empty:
            return _NO_COMMAND

    def _run_commands(self, item: Any) -> None:
        """Run ``item`` and every command queued behind it."""
        if item is _NO_COMMAND:
            return
        while item is not None:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:
                    future.set_exception(e)
            self._taken += 1
            self._taken_cond.notify_all()
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _publish(self, events: list[tuple[str, Any]]) -> None:
        with self._lock:
            for request_id, event in events:
                put = self._subscribers.get(request_id)
                if put is not None:
                    put(event)

    def _fail_everyone(self, error: BaseException) -> None:
        dead = EngineDead(f"the engine loop has stopped: {error!r}")
        with self._lock:
            for put in self._subscribers.values():
                put(dead)
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(dead)


def lower_thread_priority(niceness: int) -> bool:
    """Add ``niceness`` to the calling thread's nice value (Linux: a thread's own; the threads it
    starts from now on inherit it). False where it is 0 or the system refuses."""
    if niceness <= 0 or not sys.platform.startswith("linux"):  # elsewhere a thread id is no process id
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)
    except (AttributeError, OSError) as e:  # not Linux, or not allowed: the thread keeps its priority
        log.debug("thread %s keeps its priority: %s", threading.current_thread().name, e)
        return False
    return True


_NO_COMMAND = object()


def _failing_at(step: Step, n: int) -> Step:
    count = 0

    def failing() -> list[tuple[str, Any]]:
        nonlocal count
        count += 1
        if count >= n:
            raise RuntimeError(f"injected fault: engine step {count} fails ({FAIL_STEP_ENV}={n})")
        return step()
    return failing


def _retrieved(future: asyncio.Future) -> None:
    """Read a shielded command's outcome, so one whose caller left logs no 'never retrieved'."""
    if not future.cancelled() and future.exception() is not None:
        log.warning("engine command failed after its caller left: %r", future.exception())


def _slowed(step: Step, delay_s: float) -> Step:
    def slow() -> list[tuple[str, Any]]:
        time.sleep(delay_s)
        return step()
    return slow


async def next_event(events: asyncio.Queue, timeout: float | None = None) -> Any:
    """The next event of a subscription; an exception published by the loop (the engine died)
    is raised here. ``asyncio.TimeoutError`` after ``timeout`` seconds. No polling: a caller
    that goes away cancels the awaiting handler task."""
    event = await wait_for(events.get(), timeout)
    if isinstance(event, BaseException):
        raise event
    return event
