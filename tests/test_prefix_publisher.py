"""A worker's prefix directory updates (splitserve/worker/prefix_publisher.py) over a real, private
redis-server: a KV manager's cached blocks appear and go; entries Redis lost (expired, or Redis
away and back without them) are written whole again; stopping leaves the rest to deregister."""
import asyncio
import time

from splitserve.engine.block_pool import prefix_block_hashes
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.prefix_holdings import DEVICE
from splitserve.state.store import RedisState, make_async_client
from splitserve.worker.engine_loop import EngineLoop
from splitserve.worker.prefix_publisher import PrefixPublisher
from tests.harness.redis_server import RedisServer

BLOCK = 4


def cache(kv: KVCacheManager, request_id: str, tokens: list[int]) -> None:
    """A request computes ``tokens`` and ends: its full blocks stay cached."""
    kv.allocate(request_id, len(tokens), kv.find_cached_prefix(tokens))
    kv.cache_full_blocks(request_id, tokens, len(tokens))
    kv.free(request_id)


async def directory_of(state: RedisState, worker_id: str) -> dict[int, int]:
    return {int(k): int(v) for k, v in (await state.client.hgetall(state.prefixes_key(worker_id))).items()}


async def until(predicate, timeout_s: float = 10.0) -> None:
    give_up = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < give_up, "the directory did not catch up"
        await asyncio.sleep(0.02)


def test_the_directory_follows_the_pool_and_is_rewritten_when_lost():
    kv = KVCacheManager(6, BLOCK)
    loop = EngineLoop(lambda: [], lambda: False, name="test-engine").start()
    first, second = list(range(10, 22)), list(range(50, 62))  # 3 blocks each; the pool holds 6

    async def main(server):
        state = RedisState(make_async_client(server.url))
        publisher = PrefixPublisher(state, "w1", loop, kv.holdings, interval_s=0.02).start()
        want = dict.fromkeys(prefix_block_hashes(first, BLOCK), DEVICE)
        await loop.run(lambda: cache(kv, "a", first))
        await until(lambda: _equals(state, want))
        await loop.run(lambda: cache(kv, "b", second))
        want |= dict.fromkeys(prefix_block_hashes(second, BLOCK), DEVICE)
        await until(lambda: _equals(state, want))
        # A third prompt evicts the first's blocks (the least recently freed): they leave the directory.
        third = list(range(90, 102))
        await loop.run(lambda: cache(kv, "c", third))
        want = {**dict.fromkeys(prefix_block_hashes(second, BLOCK), DEVICE),
                **dict.fromkeys(prefix_block_hashes(third, BLOCK), DEVICE)}
        await until(lambda: _equals(state, want))
        # Redis loses the entries: the next change finds them gone and everything is written again.
        await state.client.delete(state.prefixes_key("w1"))
        await loop.run(lambda: cache(kv, "d", second))  # a hit: nothing moves, but the TTL refresh notices
        fourth = list(range(130, 138))  # 2 blocks: evicts two of the third's
        await loop.run(lambda: cache(kv, "e", fourth))
        held = await loop.run(lambda: dict.fromkeys(kv.pool._cached, DEVICE))  # the pool's own map
        assert len(held) == 6 and set(prefix_block_hashes(fourth, BLOCK)) <= set(held)
        await until(lambda: _equals(state, held))
        # Redis away while blocks move, then back empty: everything is written again.
        server.kill()
        await loop.run(lambda: cache(kv, "f", first))
        await asyncio.sleep(0.2)  # updates fail meanwhile
        server.start()
        held = await loop.run(lambda: dict.fromkeys(kv.pool._cached, DEVICE))
        assert set(prefix_block_hashes(first, BLOCK)) <= set(held)
        await until(lambda: _equals(state, held))
        await publisher.stop()
        assert await state.client.pttl(state.prefixes_key("w1")) > 0  # until deregister or its TTL
        await state.client.aclose()

    async def _equals(state, want):
        return await directory_of(state, "w1") == want

    try:
        with RedisServer() as server:
            asyncio.run(main(server))
    finally:
        loop.stop()
