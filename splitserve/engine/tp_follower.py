"""A tensor-parallel rank r > 0: load its shard, then run every forward rank 0 sends, until told to stop.

Started by ``splitserve.engine.tensor_parallel.ranks.FollowerRanks`` with its spec in
``SPLITSERVE_TP_SPEC``: ``python -m splitserve.engine.tp_follower`` (this module: its own pool, no
KV handoff) or a KV connector's program, whose ``main()`` calls ``run`` with the connector's
follower side and pool (``splitserve.worker.tp_follower``). It exits when rank 0 says so, when rank
0's control socket closes (rank 0 died), or when a collective fails (another rank died): never
left running on its own.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Callable

import torch

from splitserve.engine.kv_connector import FollowerKVConnector
from splitserve.engine.model_runner import ModelRunner, PoolFactory, default_pool, resolve_device
from splitserve.engine.tensor_parallel import dist_backend, messages, rank_device
from splitserve.engine.tensor_parallel.ranks import SPEC_ENV, communicator, init_group

log = logging.getLogger("splitserve.tp")

# (rank, this rank's pool [layers, 2, blocks, block_size, kv_heads, row]) -> its KV connector side.
ConnectorFactory = Callable[[int, torch.Tensor], FollowerKVConnector]


def run(connector: ConnectorFactory | None = None, pool_factory: PoolFactory = default_pool) -> int:
    """The rank's life. ``connector``: builds this rank's side of a KV connector once its pool
    exists (None: the engine alone, as an offline ``LLM`` runs); ``pool_factory``: where the pool lives."""
    spec = json.loads(os.environ[SPEC_ENV])
    parent = os.getppid()  # rank 0
    rank, world = spec["rank"], spec["world"]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(name)s: %(message)s")
    if spec["num_threads"] > 0:
        torch.set_num_threads(spec["num_threads"])
    from splitserve.engine.config import EngineConfig
    config = EngineConfig(**spec["config"])
    device = rank_device(resolve_device(config.device), rank)
    group = init_group(dist_backend(device), "127.0.0.1", spec["store_port"], rank, world)
    sock = socket.create_connection(("127.0.0.1", spec["control_port"]))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    messages.send(sock, (spec["token"], rank))
    kv = None
    rank0_gone = False
    try:
        all_reduce = communicator(group, spec["shm_path"], rank, world, spec["slot_bytes"])
        runner = ModelRunner(config, Path(spec["model_dir"]), pool_factory=pool_factory, tp_rank=rank,
                             tp_comm=all_reduce)
        kv = connector(rank, runner.kv_cache) if connector is not None else None
        serve(runner, kv, sock)
    except EOFError:
        log.warning("rank 0 went away; stopping")
        rank0_gone = True
        return 1
    finally:
        if kv is not None:
            kv.close()
        if spec["shm_path"] and (rank0_gone or os.getppid() != parent):
            # Rank 0 died (killed, say) without removing the all-reduce file it made: remove it here.
            Path(spec["shm_path"]).unlink(missing_ok=True)
    return 0


def serve(runner: ModelRunner, kv: FollowerKVConnector | None, sock: socket.socket) -> None:
    while True:
        message = messages.recv(sock)
        if message is None:
            return
        if not isinstance(message, messages.StepMessage):  # the KV connector's set-up
            if kv is None:
                raise RuntimeError(f"a {type(message).__name__} for a rank without a KV connector")
            messages.send(sock, kv.setup(message))
            continue
        orders = message.kv_orders
        runner.follow(message, (lambda layer: kv.save_layer(orders, layer)) if orders else None)
        if message.wants_reply:
            messages.send(sock, kv.finish_step(orders))


def main() -> int:
    return run()


if __name__ == "__main__":
    sys.exit(main())
