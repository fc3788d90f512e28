"""The gateway's grpc.health.v1 status means "can do work now".

SERVING only while Redis answers and the registry holds a set of workers that can serve a
request (a prefill and a decode worker, or a colocated one), and not while draining. A load
balancer or compose health check reading it stops sending traffic that would only fail.
"""
from __future__ import annotations

import logging
import threading

from grpc_health.v1 import health_pb2

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NO_WORKERS = "no usable workers: a prefill and a decode worker, or a colocated one, must be registered"


class GatewayHealth:
    def __init__(self, health, services: list[str], state, directory, interval_s: float = 1.0):
        self.health = health
        self.services = list(services) + [""]
        self.state = state
        self.directory = directory
        self.interval_s = interval_s
        self.draining = False
        self.reason = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health", daemon=True)

    def start(self) -> "GatewayHealth":
        self.refresh()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    @property
    def no_workers(self) -> bool:
        """No usable set of workers is registered (new requests would only wait, then fail)."""
        return self.reason.startswith(NO_WORKERS)

    def drain(self) -> None:
        self.draining = True
        self.refresh()

    def check(self) -> str:
        """Why the gateway cannot serve now ("" when it can)."""
        if self.draining:
            return "draining"
        try:
            self.state.ping()
            roles = {w.role for w in self.directory.usable()}
        except Exception as e:  # Redis down or unreachable
            return f"request store (Redis) unreachable: {e}"
        if "both" in roles or {"prefill", "decode"} <= roles:
            return ""
        return f"{NO_WORKERS} (registered: {', '.join(sorted(roles)) or 'none'})"

    def refresh(self) -> None:
        reason = self.check()
        if reason != self.reason:
            log.log(logging.WARNING if reason else logging.INFO, "health: %s", reason or "serving")
            self.reason = reason
        for name in self.services:
            self.health.set(name, NOT_SERVING if reason else SERVING)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.refresh()
