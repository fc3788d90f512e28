"""The gateway's view of the workers: who is alive (Redis heartbeats), how to reach them, whom to pick."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from splitserve.v1 import worker_pb2_grpc

# How long a listing of the workers is reused before Redis is asked again.
REFRESH_S = 0.5


@dataclass
class WorkerView:
    worker_id: str
    role: str  # prefill | decode | both
    address: str
    transports: list[str] = field(default_factory=list)
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    num_running: int = 0
    num_waiting: int = 0
    metrics_address: str = ""

    @classmethod
    def from_registry(cls, entry: dict) -> "WorkerView":
        stats = entry.get("stats") or {}
        return cls(worker_id=entry["worker_id"], role=entry["role"], address=entry["address"],
                   transports=list(entry.get("transports") or []),
                   kv_blocks_total=int(stats.get("kv_blocks_total", 0)),
                   kv_blocks_free=int(stats.get("kv_blocks_free", 0)),
                   kv_blocks_cached=int(stats.get("kv_blocks_cached", 0)),
                   num_running=int(stats.get("num_running", 0)), num_waiting=int(stats.get("num_waiting", 0)),
                   metrics_address=str(stats.get("metrics_address", "")))


class WorkerDirectory:
    def __init__(self, state):
        self.state = state
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._cached: list[WorkerView] = []
        self._cached_at = 0.0
        # Requests this gateway has in flight per worker: fresher than heartbeats.
        self.inflight: dict[str, int] = {}

    def list(self) -> list[WorkerView]:
        now = time.monotonic()
        with self._lock:
            if now - self._cached_at > REFRESH_S:
                self._cached = [WorkerView.from_registry(e) for e in self.state.workers()]
                self._cached_at = now
            return list(self._cached)

    def channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = grpc.insecure_channel(address)
            return self._channels[address]

    def decode_stub(self, worker: WorkerView) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self.channel(worker.address))

    def prefill_stub(self, worker: WorkerView) -> worker_pb2_grpc.PrefillWorkerStub:
        return worker_pb2_grpc.PrefillWorkerStub(self.channel(worker.address))

    def decode_candidates(self) -> list[WorkerView]:
        """Decode-capable workers, most free KV first, then fewest requests in flight from here."""
        workers = [w for w in self.list() if w.role in ("decode", "both")]
        return sorted(workers, key=lambda w: (-w.kv_blocks_free, self.inflight.get(w.worker_id, 0)))

    def pick_prefill(self) -> WorkerView | None:
        workers = [w for w in self.list() if w.role == "prefill"]
        if not workers:
            return None
        return min(workers, key=lambda w: (self.inflight.get(w.worker_id, 0), w.num_running + w.num_waiting))

    def track(self, worker_id: str, delta: int) -> None:
        with self._lock:
            self.inflight[worker_id] = self.inflight.get(worker_id, 0) + delta

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
