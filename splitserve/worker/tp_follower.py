"""A tensor-parallel rank r > 0 of a prefill or decode worker: the engine's follower loop
(``splitserve.engine.tp_follower.run``) with kvtransfer's side of the handoff on this rank's
slice of every page, its pool in shared memory so same-host senders can map it.

Started by rank 0 as ``python -m splitserve.worker.tp_follower`` (``wiring.KV_FOLLOWER``).
"""
from __future__ import annotations

import sys

from splitserve.engine.tp_follower import run
from splitserve.kvtransfer.tensor_parallel import FollowerKV, FollowerPool


def main() -> int:
    pool = FollowerPool()
    try:
        return run(lambda rank, cache: FollowerKV(rank, cache, pool.directory), pool)
    finally:
        pool.remove()


if __name__ == "__main__":
    sys.exit(main())
