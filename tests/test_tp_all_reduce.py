"""The shared-memory all-reduce of CPU tensor-parallel ranks: exact sums, the same bits on every
rank, hundreds of calls in a row over the two alternating slots, the process group for tensors
too large for a slot, and a waiting rank woken with an error when a rank dies."""
import datetime
import multiprocessing
import threading
import time

import pytest
import torch
import torch.distributed as dist

from splitserve.engine.tensor_parallel.all_reduce import ShmAllReduce, create_shm_file

WORLD, SLOT_BYTES, CALLS = 3, 4096, 300


def partial(rank: int, call: int) -> torch.Tensor:
    """What rank ``rank`` contributes to call ``call``: values whose float sum depends on the order."""
    g = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(7, 13, generator=g) * 10 ** (rank - 1)


def _rank(rank: int, port: int, path: str, out) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    group = dist.ProcessGroupGloo(store, rank, WORLD, datetime.timedelta(seconds=60))
    comm = ShmAllReduce(group, path, rank, WORLD, SLOT_BYTES)
    sums = [comm(partial(rank, call)) for call in range(CALLS)]
    big = comm(torch.full((SLOT_BYTES,), float(rank + 1)))  # 4x a slot: through the process group
    # As numpy arrays: pickled by value. A tensor would travel as a file descriptor that the parent
    # fetches from this process when it unpickles it, which fails once this process has exited.
    out.put((rank, torch.stack(sums).numpy(), big.numpy()))


def test_every_rank_gets_the_same_exact_sum_on_every_call(tmp_path):
    from splitserve.common.processes import free_port
    path = create_shm_file(WORLD, SLOT_BYTES)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(path), out)) for r in range(WORLD)]
    try:
        for p in procs:
            p.start()
        got = {rank: (torch.from_numpy(sums), torch.from_numpy(big))
               for rank, sums, big in (out.get(timeout=120) for _ in range(WORLD))}
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        path.unlink(missing_ok=True)
        for p in procs:
            if p.is_alive():
                p.kill()
    expected = torch.stack([partial(0, c) + partial(1, c) + partial(2, c) for c in range(CALLS)])  # rank order
    for rank in range(WORLD):
        sums, big = got[rank]
        assert torch.equal(sums, expected), rank  # bit for bit: every rank adds in the same order
        assert torch.equal(big, torch.full((SLOT_BYTES,), 6.0))


def test_a_rank_waiting_for_a_dead_one_is_woken_with_an_error():
    path = create_shm_file(2, SLOT_BYTES)
    try:
        waiting = ShmAllReduce(None, path, 0, 2, SLOT_BYTES)
        errors = []

        def call():
            try:
                waiting(torch.ones(4))
            except RuntimeError as e:
                errors.append(e)
        thread = threading.Thread(target=call)
        thread.start()
        time.sleep(0.3)
        assert thread.is_alive()  # rank 1 never publishes: rank 0 waits
        ShmAllReduce(None, path, 1, 2, SLOT_BYTES).abort()  # what rank 0's watcher does when a rank exits
        thread.join(10)
        assert not thread.is_alive() and "a rank of this worker died" in str(errors[0])
    finally:
        path.unlink(missing_ok=True)
