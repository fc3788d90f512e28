"""A tensor-parallel rank r > 0: load its shard, then run every forward rank 0 sends, until told to stop.

Started by ``splitserve.engine.tensor_parallel.ranks.FollowerRanks`` with its spec in ``SPLITSERVE_TP_SPEC``.
It holds its own KV pool (its KV heads of every page, same page ids as rank 0) and, in a
disaggregated worker, its own kvtransfer end (``splitserve.kvtransfer.tensor_parallel``). It exits when rank
0 says so, when rank 0's control socket closes (rank 0 died), or when a collective fails (another
rank died): never left running on its own.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
from pathlib import Path

import torch

from splitserve.engine.tensor_parallel import dist_backend, messages, rank_device
from splitserve.engine.tensor_parallel.ranks import SPEC_ENV, communicator, init_group

log = logging.getLogger("splitserve.tp")


def main() -> int:
    spec = json.loads(os.environ[SPEC_ENV])
    parent = os.getppid()  # rank 0
    rank, world = spec["rank"], spec["world"]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(name)s: %(message)s")
    if spec["num_threads"] > 0:
        torch.set_num_threads(spec["num_threads"])
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.model_runner import ModelRunner, resolve_device
    config = EngineConfig(**spec["config"])
    device = rank_device(resolve_device(config.device), rank)
    group = init_group(dist_backend(device), "127.0.0.1", spec["store_port"], rank, world)
    sock = socket.create_connection(("127.0.0.1", spec["control_port"]))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    messages.send(sock, (spec["token"], rank))
    from splitserve.kvtransfer.tensor_parallel import FollowerKV, FollowerPool
    pool = FollowerPool()
    kv = None
    rank0_gone = False
    try:
        all_reduce = communicator(group, spec["shm_path"], rank, world, spec["slot_bytes"])
        runner = ModelRunner(config, Path(spec["model_dir"]), pool_factory=pool, tp_rank=rank, tp_comm=all_reduce)
        kv = FollowerKV(rank, runner.kv_cache, pool.directory)
        serve(runner, kv, sock)
    except EOFError:
        log.warning("rank 0 went away; stopping")
        rank0_gone = True
        return 1
    finally:
        if kv is not None:
            kv.close()
        pool.remove()
        if spec["shm_path"] and (rank0_gone or os.getppid() != parent):
            # Rank 0 died (killed, say) without removing the all-reduce file it made: remove it here.
            Path(spec["shm_path"]).unlink(missing_ok=True)
    return 0


def serve(runner, kv, sock: socket.socket) -> None:
    while True:
        message = messages.recv(sock)
        if message is None:
            return
        if isinstance(message, messages.KVSetup):
            messages.send(sock, kv.setup(message))
            continue
        on_layer = (lambda layer: kv.copy_layer(message.copies, layer)) if message.copies else None
        runner.follow(message, on_layer)
        if message.wants_reply:
            messages.send(sock, kv.flush(message.copies))


if __name__ == "__main__":
    sys.exit(main())
