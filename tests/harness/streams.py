"""Greedy requests streamed on threads, as the reliability tests and benchmarks drive a stack.

    streams = run_streams(stack, "tag", mixed_prompts(8, seed=1), max_tokens=16)
    join_all(streams)                      # bounded
    assert_all_match(streams, reference)   # every token equals transformers' greedy output
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time

import grpc

from tests.harness.stack import worker_info
from splitserve.v1 import generation_pb2

STREAM_TIMEOUT_S = 120.0


class Stream(threading.Thread):
    """One greedy request streamed on its own thread: tokens as they come, then the outcome."""

    def __init__(self, client, request_id: str, prompt: list[int], max_tokens: int, priority: int = 0):
        super().__init__(daemon=True)
        self.client, self.request_id, self.prompt, self.max_tokens = client, request_id, prompt, max_tokens
        self.priority = priority
        self.tokens: list[int] = []
        self.first_token_at: float | None = None  # time.monotonic() when the first token arrived
        self.final = None
        self.code = None
        self.error = ""
        self.retry_after_ms = None

    def run(self):
        try:
            for event in self.client.generate(self.prompt, request_id=self.request_id, timeout=STREAM_TIMEOUT_S,
                                              priority=self.priority, max_tokens=self.max_tokens, temperature=0.0,
                                              ignore_eos=True):
                if event.finished:
                    self.final = event
                else:
                    if self.first_token_at is None and event.token_ids:
                        self.first_token_at = time.monotonic()
                    self.tokens += event.token_ids
        except grpc.RpcError as e:
            self.code, self.error = e.code(), e.details()
            self.retry_after_ms = dict(e.trailing_metadata() or ()).get("retry-after-ms")

    def attempts(self) -> int:
        info = self.client.stub.GetRequest(generation_pb2.GetRequestRequest(request_id=self.request_id), timeout=5)
        return info.attempt


def run_streams(stack, tag: str, prompts, max_tokens: int, client=None) -> list[Stream]:
    streams = [Stream(client or stack.client, f"{tag}-{i}", p, max_tokens) for i, p in enumerate(prompts)]
    for s in streams:
        s.start()
    return streams


def join_all(streams, timeout_s: float = STREAM_TIMEOUT_S) -> None:
    give_up = time.monotonic() + timeout_s
    for s in streams:
        s.join(max(0.0, give_up - time.monotonic()))
    hung = [s.request_id for s in streams if s.is_alive()]
    assert not hung, f"requests still running after {timeout_s:.0f} s: {hung}"


def assert_all_match(streams, reference) -> None:
    for s in streams:
        assert s.code is None, f"{s.request_id}: {s.code} {s.error}"
        assert s.tokens == reference.greedy(s.prompt, s.max_tokens), f"{s.request_id} differs from transformers"
        assert s.final.finish_reason == "length"


def wait_until(predicate, timeout_s: float, what: str) -> None:
    give_up = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < give_up, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.02)


async def until(predicate, timeout_s: float, what: str) -> None:
    """``wait_until`` on an event loop: its other tasks run meanwhile."""
    give_up = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < give_up, f"timed out after {timeout_s:.0f} s waiting for {what}"
        await asyncio.sleep(0.02)


@contextlib.contextmanager
def frozen(proc):
    """SIGSTOP ``proc`` for the block: alive, holding its sockets, answering nothing."""
    proc.send_signal(signal.SIGSTOP)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGCONT)


def busy(stack, name: str) -> bool:
    info = worker_info(stack.worker_stub(name))
    return info.num_running + info.num_waiting > 0
