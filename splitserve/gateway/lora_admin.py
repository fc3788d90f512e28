"""Loading and unloading LoRA adapters on every worker (the admin's ``LoadLoRAAdapter`` and
``UnloadLoRAAdapter``, vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``).

A request under an adapter needs it on its prefill and its decode worker, so an adapter is
loaded on every worker the gateway can use; a load that fails on one is undone on the others (a
worker never serves half a deployment's adapters by accident). The call returns once this
gateway's view of the workers (their heartbeats) shows the change, so the next request finds it.
"""
from __future__ import annotations

import asyncio
import time

import grpc

from splitserve.common.errors import (AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied,
                                      SplitserveError, Unavailable)
from splitserve.gateway.workers import WorkerDirectory, WorkerView
from splitserve.v1 import generation_pb2

# Seconds a worker may take to read an adapter; then how long the heartbeats may take to show it.
LOAD_TIMEOUT_S = 120.0
VISIBLE_TIMEOUT_S = 10.0
_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument, grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
           grpc.StatusCode.NOT_FOUND: NotFound, grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition}


class LoRAAdmin:
    def __init__(self, dispatcher, ledger):
        self.dispatcher = dispatcher  # whose directory lists the workers
        self.ledger = ledger  # bounds the Redis reads (splitserve.gateway.ledger)

    @property
    def directory(self) -> WorkerDirectory:
        return self.dispatcher.directory

    async def load(self, name: str, path: str, admin: bool) -> generation_pb2.LoRAAdapterResponse:
        _admin_only(admin)
        if not name or not path:
            raise InvalidArgument("lora_name and lora_path are required")
        request = generation_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
        workers = await self._workers()
        results = await asyncio.gather(*(self._call(w, "LoadLoRA", request) for w in workers),
                                       return_exceptions=True)
        done = [w for w, r in zip(workers, results) if not isinstance(r, BaseException)]
        failed = [(w, r) for w, r in zip(workers, results) if isinstance(r, BaseException)]
        if failed:
            undo = generation_pb2.UnloadLoRAAdapterRequest(lora_name=name)
            await asyncio.gather(*(self._call(w, "UnloadLoRA", undo) for w in done), return_exceptions=True)
            raise _client_error(*failed[0])
        await self._until_visible(name, {w.worker_id for w in done}, present=True)
        return generation_pb2.LoRAAdapterResponse(worker_ids=sorted(w.worker_id for w in done))

    async def unload(self, name: str, admin: bool) -> generation_pb2.LoRAAdapterResponse:
        _admin_only(admin)
        if not name:
            raise InvalidArgument("lora_name is required")
        holders = [w for w in await self._workers() if name in w.loras]
        if not holders:
            raise NotFound(f"no worker serves the LoRA adapter {name!r}")
        request = generation_pb2.UnloadLoRAAdapterRequest(lora_name=name)
        results = await asyncio.gather(*(self._call(w, "UnloadLoRA", request) for w in holders),
                                       return_exceptions=True)
        done = [w for w, r in zip(holders, results) if not isinstance(r, BaseException)]
        await self._until_visible(name, {w.worker_id for w in done}, present=False)
        failed = [(w, r) for w, r in zip(holders, results) if isinstance(r, BaseException)]
        if failed:
            raise _client_error(*failed[0])
        return generation_pb2.LoRAAdapterResponse(worker_ids=sorted(w.worker_id for w in done))

    async def _workers(self) -> list[WorkerView]:
        workers = await self.ledger.now(self.directory.usable())
        if not workers:
            raise Unavailable("no worker is registered")
        return workers

    def _call(self, worker: WorkerView, method: str, request):
        stub = self.directory.prefill_stub(worker) if worker.role == "prefill" else self.directory.decode_stub(worker)
        return getattr(stub, method)(request, timeout=LOAD_TIMEOUT_S)

    async def _until_visible(self, name: str, worker_ids: set[str], present: bool) -> None:
        """Wait until the registry shows ``name`` on (or off) ``worker_ids`` (their next beats)."""
        deadline = time.monotonic() + VISIBLE_TIMEOUT_S
        while time.monotonic() < deadline:
            self.directory.invalidate()
            shown = {w.worker_id for w in await self.ledger.now(self.directory.usable()) if name in w.loras}
            if (worker_ids <= shown) if present else not (worker_ids & shown):
                return
            await asyncio.sleep(0.1)
        raise Unavailable(f"the workers' heartbeats did not show the LoRA adapter {name!r} "
                          f"{'loaded' if present else 'unloaded'} within {VISIBLE_TIMEOUT_S:g} s")


def _admin_only(admin: bool) -> None:
    if not admin:
        raise PermissionDenied("loading and unloading LoRA adapters needs the admin token (--admin-token)")


def _client_error(worker: WorkerView, error: BaseException) -> SplitserveError:
    """A worker's refusal as the caller's error, naming the worker."""
    if isinstance(error, grpc.aio.AioRpcError):
        kind = _ERRORS.get(error.code(), Unavailable)
        return kind(f"worker {worker.worker_id}: {error.details()}")
    return Unavailable(f"worker {worker.worker_id}: {error!r}")
