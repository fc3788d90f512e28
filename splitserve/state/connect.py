"""Redis clients with bounded waits, for ``splitserve.state.store.RedisState`` (sync or asyncio)."""
from __future__ import annotations

from typing import Any

import redis
import redis.asyncio
from redis.backoff import ExponentialWithJitterBackoff

# An asyncio client's connections: many coroutines share a few sockets (a burst of admissions
# waits for a free one instead of opening thousands).
ASYNC_MAX_CONNECTIONS = 64
# How long a command may wait for one of them (then it fails like an outage: bounded).
ASYNC_POOL_WAIT_S = 5


def _client_kwargs(password: str | None, retry) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(socket_timeout=2, socket_connect_timeout=2, health_check_interval=5,
                                  decode_responses=True,
                                  retry=retry(ExponentialWithJitterBackoff(base=0.01, cap=0.1), retries=1))
    if password is not None:
        kwargs["password"] = password
    return kwargs


def make_client(url: str, password: str | None = None) -> redis.Redis:
    """A client with bounded waits: 2 s socket and connect timeouts, a PING before reusing a
    connection idle for 5 s, and one quick retry (a pooled connection broken by a Redis
    restart reconnects) instead of redis-py's default ten."""
    from redis.retry import Retry
    return redis.Redis.from_url(url, **_client_kwargs(password, Retry))


def make_async_client(url: str, password: str | None = None) -> redis.asyncio.Redis:
    """``make_client`` for an event loop (same timeouts and retry), over at most
    ``ASYNC_MAX_CONNECTIONS`` connections."""
    from redis.asyncio.retry import Retry
    pool = redis.asyncio.BlockingConnectionPool.from_url(url, max_connections=ASYNC_MAX_CONNECTIONS,
                                                          timeout=ASYNC_POOL_WAIT_S, **_client_kwargs(password, Retry))
    return redis.asyncio.Redis(connection_pool=pool)
