"""What the prefill and decode servicers share: identity, the engine loop, draining, Abort, GetWorkerInfo.

A worker servicer subclasses ``WorkerServicer`` and its generated gRPC base class, and provides
``step`` (one engine step -> events), ``has_work``, ``abort`` and ``busy`` (all run on the engine
loop thread). Its handlers are coroutines: they hand engine work to the loop thread and await
events, so an open stream holds no thread.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from splitserve.wire import worker_info_to_proto
from splitserve.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from splitserve.v1 import generation_pb2, worker_pb2
from splitserve.worker.engine_loop import EngineDead, EngineLoop
from splitserve.worker.grammars import GrammarPreparer

log = logging.getLogger(__name__)


def cpu_engine_of_one_rank(engine) -> bool:
    """Where ``--engine-niceness`` and thread binding apply: a CPU engine of one rank. A GPU
    engine's thread launches the kernels (its host time is the step's critical path), and
    tensor-parallel ranks after the first compute in processes of their own at the usual priority,
    which a slower rank 0 would hold up at every all-reduce."""
    device = getattr(getattr(engine, "runner", None), "device", None)
    return device is not None and device.type == "cpu" and engine.config.tensor_parallel_size == 1


def applied_niceness(engine, requested: int) -> int:
    """``--engine-niceness`` where it helps (``cpu_engine_of_one_rank``); 0 elsewhere."""
    return requested if cpu_engine_of_one_rank(engine) else 0


class WorkerServicer:
    role: str = ""

    def __init__(self, engine, worker_id: str, transports: list[str], housekeeping=None, engine_niceness: int = 0,
                 bind_threads: bool = False):
        """``engine_niceness``: how much lower the engine thread's CPU priority is (``--engine-niceness``);
        ``bind_threads``: bind its torch threads one a core where it has one for each (the worker's
        ``--no-thread-binding`` turns it off)."""
        self.engine = engine
        self.worker_id = worker_id
        self.transports = list(transports)
        self.address = ""  # set once the server listens
        self.metrics_address = ""
        self.draining = False  # SIGTERM: finish what is here, take nothing new
        # Each request's grammar is compiled before the request reaches the engine thread.
        engine_niceness = applied_niceness(engine, engine_niceness)
        self.grammars = GrammarPreparer(engine.grammars, engine.config.grammar_compile_timeout_s,
                                        engine_niceness=engine_niceness)
        self.loop = EngineLoop(self.step, self.has_work, housekeeping=housekeeping,
                               name=f"{self.role}-engine", niceness=engine_niceness,
                               bind_threads=bind_threads and cpu_engine_of_one_rank(engine))
        if hasattr(engine, "state_lock"):  # let go during each forward (run_during_step)
            engine.state_lock = self.loop.state_lock
        self.loop.start()
        followers = getattr(getattr(engine, "runner", None), "followers", None)
        if followers is not None:  # a tensor-parallel rank that dies ends this worker (exit 1)
            followers.on_death(self.loop.fail)

    # ---- what each worker kind provides (on the engine loop thread) -------------------
    def step(self) -> list[tuple[str, Any]]:
        raise NotImplementedError

    def has_work(self) -> bool:
        raise NotImplementedError

    def abort(self, request_id: str) -> bool:
        """Drop whatever ``request_id`` holds here; True if there was something."""
        raise NotImplementedError

    def busy(self) -> bool:
        """Anything running, waiting or reserved here (a drain waits until this is False)."""
        raise NotImplementedError

    # ---- shared ------------------------------------------------------------------------
    def refuse_if_draining(self) -> None:
        if self.draining:
            raise Unavailable(f"worker {self.worker_id} is shutting down; it only finishes what it has")

    def abort_soon(self, request_id: str) -> None:
        """Abort on the loop thread without waiting: for a handler whose caller went away (its
        task is being cancelled, so it must not await)."""
        try:
            self.loop.submit(lambda: self.abort(request_id))
        except EngineDead:
            pass  # a dead engine holds nothing that matters any more

    async def Abort(self, request, context):
        # Done even if the caller stops waiting first (its timeout is short, a step may be long).
        found = await self.loop.run(lambda: self.abort(request.request_id), must_run=True)
        return worker_pb2.WorkerAbortResponse(found=bool(found))

    async def LoadLoRA(self, request, context):
        """Read the adapter on a thread of its own (its files, its checks), then register it on
        the engine thread: steps go on meanwhile."""
        from splitserve.engine.lora.manager import AdapterExists
        self._check_lora(request.lora_name)
        try:
            adapter = await asyncio.to_thread(self.engine.read_lora, request.lora_name, request.lora_path)
            await self.loop.run(lambda: self.engine.register_lora(adapter))
        except AdapterExists as e:
            raise AlreadyExists(str(e)) from None
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        return generation_pb2.LoRAAdapterResponse(worker_ids=[self.worker_id])

    async def UnloadLoRA(self, request, context):
        from splitserve.engine.lora.manager import AdapterInUse
        self._check_lora(request.lora_name)
        try:
            await self.loop.run(lambda: self.engine.remove_lora(request.lora_name))
        except KeyError:
            raise NotFound(f"LoRA adapter {request.lora_name!r} is not loaded on {self.worker_id}") from None
        except AdapterInUse as e:
            raise FailedPrecondition(str(e)) from None
        return generation_pb2.LoRAAdapterResponse(worker_ids=[self.worker_id])

    def _check_lora(self, name: str) -> None:
        if not name:
            raise InvalidArgument("lora_name is required")
        if getattr(getattr(self.engine, "runner", None), "lora", None) is None:
            raise FailedPrecondition(f"worker {self.worker_id} serves no LoRA adapters (start it with --enable-lora)")

    async def GetWorkerInfo(self, request, context):
        stats = await self.loop.run(self.engine.stats)
        return worker_info_to_proto(self.worker_id, self.role, self.address, self.transports, stats,
                                    self.metrics_address)

    async def idle(self) -> bool:
        # A reservation waiting beside a step is not in busy() yet; none can start while draining.
        return self.loop.beside_calls == 0 and not await self.loop.run(self.busy, timeout=10)

    def close(self) -> None:
        self.loop.stop()
        self.grammars.close()
        if hasattr(self.engine, "close"):
            self.engine.close()
