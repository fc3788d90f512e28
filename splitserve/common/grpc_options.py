"""gRPC channel and server options every splitserve process and client shares: keepalive, and
the public API's retry policy.

Keepalive: a client pings every ``CLIENT_KEEPALIVE_S`` while a call is open, so a long stream
over a NAT or load balancer that drops idle connections stays up, and a vanished server is
noticed; the server pings too (``SERVER_KEEPALIVE_S``), so a client that vanished without a
FIN (power loss, a cut cable) has its streams cancelled and its requests' KV pages freed
instead of waiting for TCP's own timeout (hours). The server accepts client pings down to
``MIN_CLIENT_PING_S`` apart: clients configured as here are never told "too many pings".

Retries (``retry_delay``, used by ``splitserve.client`` when asked: ``retry=True``): a call that
failed with UNAVAILABLE or RESOURCE_EXHAUSTED *before any response message arrived* -- for
``Generate``, before the first token -- is sent again after the server's
``grpc-retry-pushback-ms`` when it sent one (a full queue does), else after an exponential
backoff, up to ``RETRY_MAX_ATTEMPTS`` tries and never past the call's deadline. Once a token has
been streamed the call is never retried: nothing is generated twice. Not gRPC's own
``retryPolicy`` service config: with grpcio 1.85 a server-streaming call whose every try
failed hung past its deadline (reproduced with a server that always answers UNAVAILABLE).
"""
from __future__ import annotations

import os

import grpc

CLIENT_KEEPALIVE_S = 30
SERVER_KEEPALIVE_S = 60
KEEPALIVE_TIMEOUT_S = 20
MIN_CLIENT_PING_S = 10

CLIENT_KEEPALIVE = [
    ("grpc.keepalive_time_ms", CLIENT_KEEPALIVE_S * 1000),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
    ("grpc.keepalive_permit_without_calls", 0),  # only while a call is open: idle channels stay quiet
    ("grpc.http2.max_pings_without_data", 0),  # a long prefill sends no data for a while: keep pinging
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),  # see server_options
]

# The server's ping interval and ack timeout, in seconds, for networks that need other values
# (a middlebox that drops idle connections sooner; a test that cuts one).
SERVER_KEEPALIVE_ENV = "SPLITSERVE_SERVER_KEEPALIVE_S"
KEEPALIVE_TIMEOUT_ENV = "SPLITSERVE_KEEPALIVE_TIMEOUT_S"


def server_options() -> list[tuple[str, object]]:
    """The keepalive options of every splitserve server (``SERVER_KEEPALIVE_ENV`` and
    ``KEEPALIVE_TIMEOUT_ENV`` override the interval and the timeout)."""
    every_s = float(os.environ.get(SERVER_KEEPALIVE_ENV, SERVER_KEEPALIVE_S))
    timeout_s = float(os.environ.get(KEEPALIVE_TIMEOUT_ENV, KEEPALIVE_TIMEOUT_S))
    return [
        ("grpc.keepalive_time_ms", int(every_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
        # What grpcio 1.85 waits for a ping's ack before closing the connection: without it a
        # peer gone silent mid-stream was never dropped (a 40 s test stream ran to its deadline
        # with keepalive_timeout_ms 1 s; tests/faults/test_keepalive.py).
        ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000)),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_CLIENT_PING_S * 1000),
        ("grpc.http2.max_pings_without_data", 0),
    ]

RETRY_MAX_ATTEMPTS = 5
RETRY_INITIAL_BACKOFF_S = 0.2
RETRY_MAX_BACKOFF_S = 5.0
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
PUSHBACK_KEY = "grpc-retry-pushback-ms"


def client_options() -> list[tuple[str, object]]:
    """The channel options of a client: keepalive (retries are the client's own, see above)."""
    return list(CLIENT_KEEPALIVE)


def retry_delay(error: grpc.RpcError, attempt: int, streamed: bool, time_left_s: float | None) -> float | None:
    """Seconds to wait before trying ``error``'s call again (``attempt`` tries so far), or None
    when it must not be retried: a response already arrived, a status that a retry cannot fix,
    the last try, a negative pushback (the server says: do not retry), or the deadline first."""
    if streamed or error.code() not in RETRYABLE or attempt >= RETRY_MAX_ATTEMPTS:
        return None
    pushback = dict(error.trailing_metadata() or ()).get(PUSHBACK_KEY)
    if pushback is not None:
        try:
            delay = int(pushback) / 1000
        except ValueError:
            return None
        if delay < 0:
            return None
    else:
        delay = min(RETRY_MAX_BACKOFF_S, RETRY_INITIAL_BACKOFF_S * 2 ** (attempt - 1))
    if time_left_s is not None and delay >= time_left_s:
        return None
    return delay
