"""The cluster's prefix directory in Redis: which prefix blocks each worker holds, in which tier.

One HASH per worker, ``{ss}:w:<worker id>:prefixes``: field = a block's chain hash (decimal,
``splitserve.engine.block_pool.chain_hash``, the same in every process), value = the tiers
holding it, as bits (``splitserve.engine.prefix_holdings``: 1 device, 2 host memory, 4 disk). The worker
alone writes it (``PrefixPublisher``: batched updates a few times a second, each refreshing a TTL),
gateways read it (``splitserve.gateway.prefix_routing``); it goes with the worker's registry record
(``DEREGISTER``, and ``WORKERS``' pruning of dead workers), and expires if its worker stops
publishing. Bounded by what the worker holds: its pool and tiers are.

The directory is a hint: a worker checks every block of a hit against its own cache, so an entry
gone stale costs a recomputation, never a wrong token.
"""
from __future__ import annotations

from typing import Sequence

from splitserve.state.store import RedisState, _then

# Fields per HSET / HDEL: a big update (a worker writing all it holds) goes in several commands.
CHUNK = 4096


def publish(state: RedisState, worker_id: str, held: dict[int, int], gone: Sequence[int], ttl_s: float,
            replace: bool = False):
    """Tell the directory which prefix blocks ``worker_id`` now holds (block hash -> tiers) and
    which it no longer holds; ``replace``: ``held`` is all it holds (what was there goes). One
    transaction. Returns False when the directory had nothing of the worker before and this was
    not a ``replace`` (the hash expired, or was pruned with a worker presumed dead): the caller
    then owes it everything it holds."""
    key = state.prefixes_key(worker_id)
    pipe = state.client.pipeline(transaction=True)
    pipe.exists(key)
    if replace:
        pipe.delete(key)
    items = [(str(h), tier) for h, tier in held.items()]
    for i in range(0, len(items), CHUNK):
        pipe.hset(key, mapping=dict(items[i:i + CHUNK]))
    hashes = [str(h) for h in gone]
    for i in range(0, len(hashes), CHUNK):
        pipe.hdel(key, *hashes[i:i + CHUNK])
    pipe.pexpire(key, max(1, int(ttl_s * 1000)))
    return _then(pipe.execute(), lambda replies: replace or bool(replies[0]))


def lookup(state: RedisState, worker_ids: Sequence[str], hashes: Sequence[int]):
    """Per worker of ``worker_ids``, the tiers (bits) holding each of ``hashes`` there (None where
    none does): one round trip however many workers. Both must be non-empty."""
    if not worker_ids or not hashes:
        raise ValueError("a prefix lookup needs workers and block hashes")
    fields = [str(h) for h in hashes]
    pipe = state.client.pipeline(transaction=False)
    for worker_id in worker_ids:
        pipe.hmget(state.prefixes_key(worker_id), fields)
    return _then(pipe.execute(), lambda replies: [[None if v is None else int(v) for v in reply]
                                                  for reply in replies])
