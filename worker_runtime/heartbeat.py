"""Workers announce themselves in Redis and keep a heartbeat; a worker that stops beating
drops out of every gateway's view once its alive key expires."""
from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, state, worker_id: str, role: str, address: str, transports: list[str],
                 stats: Callable[[], dict], interval_s: float = 1.0, ttl_s: float = 3.0):
        self.state = state
        self.worker_id = worker_id
        self.role = role
        self.address = address
        self.transports = transports
        self.stats = stats
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _run(self) -> None:
        registered = False
        while not self._stop.is_set():
            try:
                stats = self.stats()
                if not registered:
                    self.state.register_worker(self.worker_id, self.role, self.address, self.transports, stats,
                                               self.ttl_s)
                    registered = True
                    log.info("registered %s (%s) at %s", self.worker_id, self.role, self.address)
                else:
                    # False: our alive key lapsed and gateways may have dropped us; register anew.
                    registered = self.state.heartbeat(self.worker_id, stats, self.ttl_s)
            except Exception as e:  # Redis away: keep trying; gateways drop us meanwhile
                log.warning("heartbeat failed: %s", e)
                registered = False
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        """Stop beating and leave the registry at once (graceful shutdown)."""
        self._stop.set()
        self._thread.join(5)
        try:
            self.state.deregister(self.worker_id)
        except Exception as e:
            log.warning("deregister failed: %s", e)
