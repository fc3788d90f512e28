"""The engine in-process, as the comparisons drive it beside whole stacks.

Whole ``splitserve up`` stacks come from the launcher (``splitserve.cli.launcher.UpProcess``
and ``running``). ``InProcessBackend`` runs ``LLMEngine`` on an engine-loop thread in this
process, with the same ``stream(request)`` interface as ``GrpcBackend``, so the same load
generator measures both (the cost of gRPC + Redis + gateway is the difference).
"""
from __future__ import annotations

import itertools
from typing import Iterator

from splitserve.cli.workloads import BenchRequest


class InProcessBackend:
    """``engine.LLMEngine`` stepped by ``splitserve.worker.engine_loop.EngineLoop`` (as a worker runs it),
    called directly: no gRPC, no Redis, no gateway, no detokenizer."""

    def __init__(self, config, num_threads: int = 0):
        import torch

        from splitserve.engine.llm_engine import LLMEngine
        from splitserve.worker.engine_loop import EngineLoop
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.engine = LLMEngine(config)
        self.loop = EngineLoop(lambda: [(o.request_id, o) for o in self.engine.step()],
                               self.engine.has_unfinished_requests, name="bench-engine").start()
        self._ids = itertools.count()

    def stream(self, request: BenchRequest, meta: dict) -> Iterator[list[int]]:
        from splitserve.engine.sampling_params import SamplingParams
        rid = f"bench-{next(self._ids)}"
        events = self.loop.subscribe_sync(rid)
        params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
        try:
            self.loop.call(lambda: self.engine.add_request(rid, list(request.prompt_token_ids), params))
            seen = 0
            while True:
                out = events.get(timeout=600)
                if isinstance(out, BaseException):
                    raise out
                if len(out.token_ids) > seen:
                    yield out.token_ids[seen:]
                    seen = len(out.token_ids)
                if out.finished:
                    return
        finally:
            self.loop.unsubscribe(rid)

    def close(self) -> None:
        self.loop.stop()
