"""gRPC channel and server options every splitserve process and client shares: keepalive, and
the public API's retry policy.

Keepalive: a client pings every ``CLIENT_KEEPALIVE_S`` while a call is open, so a long stream
over a NAT or load balancer that drops idle connections stays up, and a vanished server is
noticed; the server pings too (``SERVER_KEEPALIVE_S``), so a client that vanished without a
FIN (power loss, a cut cable) has its streams cancelled and its requests' KV pages freed
instead of waiting for TCP's own timeout (hours). The server accepts client pings down to
``MIN_CLIENT_PING_S`` apart: clients configured as here are never told "too many pings".

Retries (gRPC's retry design, A6): ``retry_service_config`` lets a channel retry a call that
failed with UNAVAILABLE or RESOURCE_EXHAUSTED *before any response message arrived* -- for
``Generate``, before the first token -- after an exponential backoff, or after the server's
``grpc-retry-pushback-ms`` when it sends one (a full queue does). Once a token has been
streamed the call is committed and never retried: nothing is generated twice.
"""
from __future__ import annotations

import json

CLIENT_KEEPALIVE_S = 30
SERVER_KEEPALIVE_S = 60
KEEPALIVE_TIMEOUT_S = 20
MIN_CLIENT_PING_S = 10

CLIENT_KEEPALIVE = [
    ("grpc.keepalive_time_ms", CLIENT_KEEPALIVE_S * 1000),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
    ("grpc.keepalive_permit_without_calls", 0),  # only while a call is open: idle channels stay quiet
    ("grpc.http2.max_pings_without_data", 0),  # a long prefill sends no data for a while: keep pinging
]

SERVER_KEEPALIVE = [
    ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_S * 1000),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_CLIENT_PING_S * 1000),
    ("grpc.http2.max_pings_without_data", 0),
]

# The public service: retried before any response; the worker services are the gateway's own
# business (it retries attempts itself, on another worker).
PUBLIC_SERVICE = "splitserve.v1.Generation"
RETRY_MAX_ATTEMPTS = 5  # gRPC caps maxAttempts at 5


def retry_service_config(service: str = PUBLIC_SERVICE, max_attempts: int = RETRY_MAX_ATTEMPTS) -> str:
    """The channel option value (``grpc.service_config``) of the retry policy described above."""
    policy = {"maxAttempts": max_attempts, "initialBackoff": "0.2s", "maxBackoff": "5s", "backoffMultiplier": 2,
              "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"]}
    return json.dumps({"methodConfig": [{"name": [{"service": service}], "retryPolicy": policy}]})


def client_options(retry: bool) -> list[tuple[str, object]]:
    """Keepalive, and with ``retry`` the public API's retry policy (and retries turned on)."""
    if not retry:
        return [*CLIENT_KEEPALIVE, ("grpc.enable_retries", 0)]
    return [*CLIENT_KEEPALIVE, ("grpc.enable_retries", 1), ("grpc.service_config", retry_service_config())]
