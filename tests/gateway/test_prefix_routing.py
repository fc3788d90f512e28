"""The cluster's prefix directory (splitserve/state/prefixes.py) and the placement on it
(splitserve/gateway/prefix_routing.py), over a real, private redis-server with workers registered
as workers register: what a worker publishes every gateway reads, a cached prefix is weighed by
its length and tier against load, an adapter's prompts by its own chain, and a worker's entries
go with it."""
import asyncio
import subprocess
import time
import sys

import pytest

from splitserve.engine.block_pool import chain_root, prefix_block_hashes
from splitserve.engine.prefix_holdings import DEVICE, DISK, HOST
from splitserve.gateway.prefill_placement import DisaggregationPolicy
from splitserve.gateway.prefix_routing import MAX_BLOCKS, CachedRun, leading_run
from splitserve.gateway.workers import WorkerDirectory
from splitserve.state import prefixes
from splitserve.state.store import RedisState, make_async_client
from tests.harness.redis_server import RedisServer

BLOCK = 4
SYSTEM = list(range(100, 1124))  # 1,024 tokens: 256 blocks, worth 2 requests of load on the device


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


def run(redis_url, body):
    """``body(state, directory)`` on a fresh event loop, with a gateway's view of the workers."""
    async def main():
        state = RedisState(make_async_client(redis_url))
        await state.client.flushall()
        try:
            return await body(state, WorkerDirectory(state, block_size=BLOCK))
        finally:
            await state.client.aclose()
    return asyncio.run(main())


async def register(state, *workers, role="prefill"):
    for worker_id in workers:
        await state.register_worker(worker_id, role, f"{worker_id}:1", [], {"num_running": 0}, ttl_s=30)


def held(tokens, tier=DEVICE, lora=None):
    root = chain_root(lora) if lora else None
    return {h: tier for h in prefix_block_hashes(tokens, BLOCK, root=root)}


async def pick(directory, prompt, lora=None):
    return (await directory.pick_prefill(prompt, lora=lora)).worker_id


def test_a_workers_updates_are_what_every_gateway_reads(redis_url):
    async def body(state, directory):
        hashes = prefix_block_hashes(SYSTEM[:40], BLOCK)  # 10 blocks
        assert await prefixes.publish(state, "w1", dict.fromkeys(hashes, DEVICE), [], ttl_s=30, replace=True)
        # Blocks move down a tier and out: the leading run ends at the first one gone.
        assert await prefixes.publish(state, "w1", {hashes[3]: HOST, hashes[4]: DISK}, [hashes[6]], ttl_s=30)
        tiers = (await prefixes.lookup(state, ["w1", "w2"], hashes))
        assert tiers[0] == [DEVICE] * 3 + [HOST, DISK, DEVICE, None] + [DEVICE] * 3
        assert tiers[1] == [None] * 10
        assert leading_run(tiers[0]) == CachedRun(device=4, host=1, disk=1)
        assert leading_run([DEVICE | HOST, HOST | DISK, DISK, 0]) == CachedRun(device=1, host=1, disk=1)
        # A second gateway (its own client) reads the same.
        other = RedisState(make_async_client(redis_url))
        assert await prefixes.lookup(other, ["w1"], hashes) == tiers[:1]
        await other.client.aclose()
        # A replace keeps only what it names.
        await prefixes.publish(state, "w1", {hashes[0]: HOST}, [], ttl_s=30, replace=True)
        assert (await prefixes.lookup(state, ["w1"], hashes))[0] == [HOST] + [None] * 9
        # Entries that expired (or were pruned): an update that is not a replace says so.
        await state.client.delete(state.prefixes_key("w1"))
        assert not await prefixes.publish(state, "w1", {hashes[1]: DEVICE}, [], ttl_s=30)
        ttl = await state.client.pttl(state.prefixes_key("w1"))
        assert 0 < ttl <= 30_000
    run(redis_url, body)


def test_a_cached_prefix_outweighs_a_little_load_not_a_lot(redis_url):
    async def body(state, directory):
        await register(state, "p1", "p2")
        await prefixes.publish(state, "p2", held(SYSTEM), [], ttl_s=30, replace=True)
        prompt = SYSTEM + [7, 8, 9]
        first = await pick(directory, prompt)
        assert first == "p2"
        directory.track("p2", 1)  # one request more there: 1,024 cached tokens still win
        assert await pick(directory, prompt) == "p2"
        directory.track("p2", 2)  # three more: the idle worker's recomputation is the shorter wait
        assert await pick(directory, prompt) == "p1"
        # A prompt sharing nothing goes by load; so does every prompt with --prefix-routing load.
        assert await pick(directory, [1, 2, 3, 4, 5, 6, 7, 8]) == "p1"
        directory.track("p2", -3)
        blind = WorkerDirectory(state, block_size=BLOCK, prefix_routing=False)
        blind.track("p1", 1)
        directory.track("p1", 1)
        assert await pick(blind, [1, 2, 3, 4, 5, 6, 7, 8]) == "p2"
        blind.track("p2", 1)
        directory.track("p2", 1)
        # Both loaded alike: the blind gateway goes by heartbeat load and list order, the other to the cache.
        assert await pick(directory, prompt) == "p2"
        holder = {await pick(blind, prompt) for _ in range(3)}
        assert len(holder) == 1
    run(redis_url, body)


def test_the_longer_run_and_the_better_tier_win(redis_url):
    async def body(state, directory):
        await register(state, "p1", "p2", "p3")
        await prefixes.publish(state, "p1", held(SYSTEM[:256]), [], ttl_s=30, replace=True)
        await prefixes.publish(state, "p2", held(SYSTEM[:768]), [], ttl_s=30, replace=True)
        assert await pick(directory, SYSTEM) == "p2"
        # p3 holds the whole prompt, on disk: 1,024 x 0.5 < 768 device tokens.
        await prefixes.publish(state, "p3", held(SYSTEM, DISK), [], ttl_s=30, replace=True)
        assert await pick(directory, SYSTEM) == "p2"
        # In host memory: 1,024 x 0.8 > 768.
        await prefixes.publish(state, "p3", held(SYSTEM, HOST), [], ttl_s=30, replace=True)
        assert await pick(directory, SYSTEM) == "p3"
        # Only the leading run counts: p1 lacking one early block has 1 block, not 255.
        hashes = prefix_block_hashes(SYSTEM, BLOCK)
        await prefixes.publish(state, "p1", held(SYSTEM), [hashes[1]], ttl_s=30, replace=True)
        cached = await directory.prefixes.lookup(["p1", "p2", "p3"], SYSTEM)
        assert cached["p1"] == CachedRun(device=1) and cached["p2"] == CachedRun(device=192)
        # Past MAX_BLOCKS nothing is looked up.
        long = list(range(MAX_BLOCKS * BLOCK + 64))
        await prefixes.publish(state, "p1", held(long), [], ttl_s=30, replace=True)
        assert (await directory.prefixes.lookup(["p1"], long))["p1"].blocks == MAX_BLOCKS
    run(redis_url, body)


def test_an_adapters_prompts_follow_its_own_chain(redis_url):
    async def body(state, directory):
        await register(state, "p1", "p2")
        for worker in ("p1", "p2"):
            await state.heartbeat(worker, {"num_running": 0, "loras": ["sql"]}, ttl_s=30)
        await prefixes.publish(state, "p1", held(SYSTEM), [], ttl_s=30, replace=True)  # the base model's
        await prefixes.publish(state, "p2", held(SYSTEM, lora="sql"), [], ttl_s=30, replace=True)
        assert await pick(directory, SYSTEM) == "p1"
        assert await pick(directory, SYSTEM, lora="sql") == "p2"
    run(redis_url, body)


def test_a_colocated_workers_cache_counts_in_full_a_decode_workers_a_quarter(redis_url):
    async def body(state, directory):
        await register(state, "b1", "b2", role="both")
        await prefixes.publish(state, "b2", held(SYSTEM), [], ttl_s=30, replace=True)
        directory.track("b2", 1)
        assert [w.worker_id for w in await directory.decode_candidates(None, SYSTEM)] == ["b2", "b1"]
        await state.client.flushall()
        await register(state, "d1", "d2", role="decode")
        await register(state, "p1")
        await prefixes.publish(state, "d2", held(SYSTEM), [], ttl_s=30, replace=True)
        directory.invalidate()
        assert [w.worker_id for w in await directory.decode_candidates(None, SYSTEM)][0] == "d2"
        directory.track("d2", 1)  # worth 0.5 requests on a decode worker: one in flight outweighs it
        assert [w.worker_id for w in await directory.decode_candidates(None, SYSTEM)][0] == "d1"
    run(redis_url, body)


def test_a_workers_entries_go_with_it(redis_url):
    async def body(state, directory):
        await register(state, "p1", "p2")
        await prefixes.publish(state, "p2", held(SYSTEM), [], ttl_s=30, replace=True)
        directory.track("p1", -1)  # p1 the idler
        assert await pick(directory, SYSTEM) == "p2"
        await state.deregister("p2")
        assert not await state.client.exists(state.prefixes_key("p2"))
        # A worker presumed dead (its alive key lapsed) is pruned with its entries.
        await prefixes.publish(state, "p1", held(SYSTEM), [], ttl_s=30, replace=True)
        await state.client.delete(state.alive_key("p1"))
        assert await state.workers() == []
        assert not await state.client.exists(state.prefixes_key("p1"))
    run(redis_url, body)


def test_chain_hashes_are_the_same_in_every_process():
    """Gateways compute the hashes workers publish: ``hash(None)`` differs per process on Python
    3.11, and string hashes per PYTHONHASHSEED."""
    code = "from splitserve.engine.block_pool import prefix_block_hashes as p; print(p(list(range(12)), 4))"
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={"PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2", "random")}
    assert outputs == {str(prefix_block_hashes(list(range(12)), 4))}


def test_a_block_in_a_shared_host_tier_counts_for_every_worker_that_maps_it(redis_url):
    async def body(state, directory):
        await register(state, "p1", "p2", "p3")
        for worker, host in (("p1", "A"), ("p2", "A"), ("p3", "B")):
            await state.heartbeat(worker, {"num_running": 0, "host_id": host, "kv_tier_shared": "tier-x"}, ttl_s=30)
        # p1 holds the first half on its device, and the whole prompt is in the shared tier.
        hashes = prefix_block_hashes(SYSTEM, BLOCK)
        await prefixes.publish(state, "p1", {**held(SYSTEM, HOST), **held(SYSTEM[:512], DEVICE | HOST)}, [],
                               ttl_s=30, replace=True)
        directory.invalidate()
        cached = await directory.prefixes.lookup(["p1", "p2", "p3"], SYSTEM, shared={
            "p1": "A/tier-x", "p2": "A/tier-x", "p3": "B/tier-x"})
        assert cached["p1"] == CachedRun(device=128, host=128)
        assert cached["p2"] == CachedRun(host=256)  # its host's tier: loadable there too
        assert "p3" not in cached  # another host's tier of the same name is another tier
        # Placement: p2 is as good a place as any for the host tier's half of it, when p1 is busy.
        directory.track("p1", 2)
        assert await pick(directory, SYSTEM) == "p2"
        assert len(hashes) == 256
    run(redis_url, body)


def test_redis_away_places_by_load():
    """The directory is a hint: a lookup that finds Redis away places the request by load."""
    async def main(server):
        state = RedisState(make_async_client(server.url))
        directory = WorkerDirectory(state, block_size=BLOCK)
        await register(state, "p1", "p2")
        await prefixes.publish(state, "p2", held(SYSTEM), [], ttl_s=30, replace=True)
        directory.track("p1", -1)
        assert await pick(directory, SYSTEM) == "p2"
        directory._cached_at = time.monotonic() + 3600  # the listing of the workers stays as it is
        server.kill()
        assert await pick(directory, SYSTEM) == "p1"
        await state.client.aclose()
    with RedisServer() as server:
        asyncio.run(main(server))


def test_a_lone_worker_is_placed_without_a_lookup_unless_its_cached_run_tells_something(redis_url):
    """Nothing to choose between: the cached run of a lone colocated worker, a lone decode worker
    under ``--disaggregation always`` and a lone prefill worker is not read (a Redis round trip off
    each request's path). Under ``auto`` a decode worker's run decides where its prompt is
    prefilled, under ``never`` it is what the worker computes: there it is still read."""
    async def body(state, directory):
        await register(state, "b1", role="both")
        await prefixes.publish(state, "b1", held(SYSTEM), [], ttl_s=30, replace=True)
        workers, cached = await directory.placement_candidates(None, SYSTEM)
        assert [w.worker_id for w in workers] == ["b1"] and cached == {}
        await register(state, "b2", role="both")
        directory.invalidate()
        workers, cached = await directory.placement_candidates(None, SYSTEM)
        assert workers[0].worker_id == "b1" and cached["b1"].blocks == len(SYSTEM) // BLOCK
        await state.client.flushall()
        await register(state, "d1", role="decode")
        await register(state, "p1", role="prefill")
        for worker in ("d1", "p1"):
            await prefixes.publish(state, worker, held(SYSTEM), [], ttl_s=30, replace=True)
        directory.invalidate()
        workers, cached = await directory.placement_candidates(None, SYSTEM)
        assert [w.worker_id for w in workers] == ["d1"] and cached == {}  # --disaggregation always
        for policy in ("auto", "never"):  # the run decides where it is prefilled / what it computes there
            reading = WorkerDirectory(state, block_size=BLOCK, disaggregation=DisaggregationPolicy(policy))
            workers, cached = await reading.placement_candidates(None, SYSTEM)
            assert [w.worker_id for w in workers] == ["d1"] and cached["d1"].blocks == len(SYSTEM) // BLOCK
        lookups = []
        real_lookup = directory.prefixes.lookup

        async def counted(*args, **kwargs):
            lookups.append(args)
            return await real_lookup(*args, **kwargs)
        directory.prefixes.lookup = counted
        assert await pick(directory, SYSTEM) == "p1" and lookups == []
        await register(state, "p2", role="prefill")
        directory.invalidate()
        assert await pick(directory, SYSTEM) == "p1" and len(lookups) == 1  # two to choose from: read
    run(redis_url, body)
