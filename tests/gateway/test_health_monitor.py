"""The gateway's readiness follows the registry: it turns SERVING as soon as a usable set of
workers registers, not at its next regular refresh nor after the directory's cached listing.
Real Redis; the health servicer is grpc's own."""
import asyncio

from grpc_health.v1 import health

from splitserve.gateway.health_monitor import GatewayHealth
from splitserve.gateway.workers import WorkerDirectory
from splitserve.state.store import RedisState, make_async_client
from tests.harness.redis_server import RedisServer
from tests.harness.streams import until

SERVICE = "splitserve.v1.Generation"
LONG_S = 30.0  # the regular refresh interval in these tests: no wait below comes near it


def with_monitor(test):
    """Run ``test(state, directory, monitor)`` against a fresh Redis."""
    async def main(url):
        state = RedisState(make_async_client(url))
        directory = WorkerDirectory(state)
        monitor = await GatewayHealth(health.aio.HealthServicer(), [SERVICE], state, directory,
                                      interval_s=LONG_S).start()
        try:
            await test(state, directory, monitor)
        finally:
            await monitor.stop()
            await directory.close()
            await state.client.aclose()
    with RedisServer() as server:
        asyncio.run(main(server.url))


def test_a_refresh_without_workers_reads_the_registry_afresh():
    async def test(state, directory, monitor):
        assert monitor.no_workers and await directory.list() == []  # an empty listing, cached
        await state.register_worker("w1", "both", "127.0.0.1:1", [], {}, ttl_s=30)
        await monitor.refresh()
        assert monitor.reason == ""
    with_monitor(test)


def test_a_gateway_without_workers_turns_ready_when_they_register_not_at_its_next_interval():
    async def test(state, directory, monitor):
        await asyncio.sleep(0.3)  # a few refreshes with nothing registered
        assert monitor.no_workers
        await state.register_worker("w1", "both", "127.0.0.1:1", [], {}, ttl_s=30)
        await until(lambda: monitor.reason == "", LONG_S / 3, "readiness before the regular interval")
        assert monitor.reason == ""
    with_monitor(test)


def test_a_drain_that_comes_while_a_refresh_waits_for_redis_is_not_undone_by_it():
    async def test(state, directory, monitor):
        await state.register_worker("w1", "both", "127.0.0.1:1", [], {}, ttl_s=30)
        await monitor.refresh()
        assert monitor.reason == ""
        ping = state.ping

        async def slow_ping():
            await asyncio.sleep(0.2)
            return await ping()
        state.ping = slow_ping
        refreshing = asyncio.ensure_future(monitor.refresh())
        await asyncio.sleep(0.05)  # the refresh is waiting for Redis
        await monitor.drain()
        await refreshing
        assert monitor.reason == "draining"
    with_monitor(test)
