"""One thread owns a worker's engine; gRPC handler threads talk to it through this loop.

The engine and the kvtransfer connectors are not thread-safe. Handlers submit closures with
``call`` (run on the loop thread between steps, result or exception handed back) and read
per-request events from ``subscribe``. The loop steps while there is work and otherwise
sleeps on its command queue, so an idle worker burns no CPU.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from splitserve.errors import Unavailable

log = logging.getLogger(__name__)

Step = Callable[[], list[tuple[str, Any]]]  # one engine step -> (request_id, event) pairs


# How often a handler waiting for engine events wakes to notice a caller that went away.
POLL_S = 0.5
# Fault injection for the reliability tests: the N-th engine step raises (0: never).
FAIL_STEP_ENV = "SPLITSERVE_FAULT_FAIL_STEP"


class EngineDead(Unavailable):
    """The engine loop stopped after a failed step; the worker must be restarted (its callers
    get UNAVAILABLE, so a gateway retries the request on another worker)."""


class EngineLoop:
    def __init__(self, step: Step, has_work: Callable[[], bool], housekeeping: Callable[[], None] | None = None,
                 housekeeping_interval_s: float = 0.5, name: str = "engine-loop"):
        fail_at = int(os.environ.get(FAIL_STEP_ENV, "0") or 0)
        self._step = _failing_at(step, fail_at) if fail_at > 0 else step
        self._has_work = has_work
        self._housekeeping = housekeeping
        self._interval = housekeeping_interval_s
        self._commands: queue.Queue = queue.Queue()
        self._subscribers: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def call(self, fn: Callable[[], Any], timeout: float | None = 60.0) -> Any:
        """Run ``fn`` on the loop thread and return its result (or raise its exception)."""
        if not self.alive:
            raise EngineDead(f"the engine loop has stopped: {self.error!r}")
        future: Future = Future()
        self._commands.put((fn, future))
        return future.result(timeout=timeout)

    def subscribe(self, request_id: str) -> queue.Queue:
        """Events for ``request_id`` from now on; call before the request can produce any."""
        q: queue.Queue = queue.Queue()
        with self._lock:
            self._subscribers[request_id] = q
        return q

    def unsubscribe(self, request_id: str) -> None:
        with self._lock:
            self._subscribers.pop(request_id, None)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)

    # ---- the thread ------------------------------------------------------------------
    def _run(self) -> None:
        next_housekeeping = time.monotonic()
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self._has_work())
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

    def _drain_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=self._interval) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:
                    future.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _publish(self, events: list[tuple[str, Any]]) -> None:
        with self._lock:
            for request_id, event in events:
                q = self._subscribers.get(request_id)
                if q is not None:
                    q.put(event)

    def _fail_everyone(self, error: BaseException) -> None:
        dead = EngineDead(f"the engine loop has stopped: {error!r}")
        with self._lock:
            for q in self._subscribers.values():
                q.put(dead)
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[1].set_exception(dead)


def _failing_at(step: Step, n: int) -> Step:
    count = 0

    def failing() -> list[tuple[str, Any]]:
        nonlocal count
        count += 1
        if count >= n:
            raise RuntimeError(f"injected fault: engine step {count} fails ({FAIL_STEP_ENV}={n})")
        return step()
    return failing


def wait_event(events: queue.Queue, context, give_up_at: float | None = None) -> Any:
    """The next event for a handler; None once its caller went away or ``give_up_at`` (monotonic) passed.

    An exception published by the loop (the engine died) is raised here.
    """
    while context.is_active():
        if give_up_at is not None and time.monotonic() > give_up_at:
            return None
        try:
            event = events.get(timeout=POLL_S)
        except queue.Empty:
            continue
        if isinstance(event, BaseException):
            raise event
        return event
    return None


def abort_when_rpc_ends(context, loop: EngineLoop, abort: Callable[[], Any]) -> threading.Event:
    """Run ``abort`` on the loop if the RPC ends (cancel, deadline, error) before the returned event is set."""
    done = threading.Event()

    def on_rpc_end():
        if not done.is_set():
            try:
                loop.call(abort, timeout=10)
            except EngineDead:
                pass
    context.add_callback(on_rpc_end)
    return done
