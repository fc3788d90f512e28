"""The gateway's readiness follows the registry: it turns SERVING as soon as a usable set of
workers registers, not at its next regular refresh. Real Redis; the health servicer is grpc's own."""
import asyncio
import time

from grpc_health.v1 import health

from splitserve.gateway.health_monitor import GatewayHealth
from splitserve.gateway.workers import WorkerDirectory
from splitserve.state.store import RedisState, make_async_client
from tests.harness.redis_server import RedisServer

SERVICE = "splitserve.v1.Generation"


async def until(condition, timeout_s: float) -> float:
    """Seconds until ``condition()`` held; fails after ``timeout_s``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "not within the bound"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def test_a_gateway_waiting_for_workers_turns_ready_when_they_register_not_at_its_next_interval():
    interval_s = 30.0  # the refresh while serving: a bound no wait below comes near

    async def main(url):
        state = RedisState(make_async_client(url))
        monitor = await GatewayHealth(health.aio.HealthServicer(), [SERVICE], state, WorkerDirectory(state),
                                      interval_s=interval_s).start()
        try:
            assert monitor.no_workers
            await asyncio.sleep(0.3)  # a few refreshes with nothing registered
            assert monitor.no_workers
            await state.register_worker("w1", "both", "127.0.0.1:1", [], {}, ttl_s=30)
            waited = await until(lambda: monitor.reason == "", timeout_s=interval_s / 3)
            print(f"ready {waited:.2f} s after the worker registered")
        finally:
            await monitor.stop()
            await state.client.aclose()
    with RedisServer() as server:
        asyncio.run(main(server.url))
