"""The shm sender on its own: both copy strategies land the same bytes, and fencing holds."""
import random

import pytest
import torch

from kvtransfer.base import KVLayout, StaleEpochError, TransferDescriptor, coalesce
from kvtransfer.lease import LeaseTable, PageFence
from kvtransfer.transports.shm import ShmReceiver, ShmSender, create_shared_pool

SHAPE = (3, 2, 64, 8, 2, 16)


@pytest.fixture
def shm_pair():
    pool, owners, directory = create_shared_pool(SHAPE, torch.bfloat16)
    receiver = ShmReceiver(pool, LeaseTable(PageFence(owners), ttl_s=60), directory)
    src = torch.randn(*SHAPE).to(torch.bfloat16)
    yield receiver, ShmSender(receiver.address, src), src
    receiver.close()


def describe(receiver, rid, dst):
    lease = receiver.leases.grant(rid, dst)
    return TransferDescriptor(rid, "shm", receiver.address, tuple(dst), KVLayout.of_pool("m", receiver.pool),
                              lease.epoch, lease.deadline)


@pytest.mark.parametrize("num_pages, fragmented", [(4, False), (4, True), (20, True), (20, False)])
def test_pages_land_byte_for_byte(shm_pair, num_pages, fragmented):
    receiver, sender, src = shm_pair
    rng = random.Random(num_pages)
    src_blocks = rng.sample(range(64), num_pages) if fragmented else list(range(10, 10 + num_pages))
    dst_blocks = rng.sample(range(64), num_pages) if fragmented else list(range(30, 30 + num_pages))
    desc = describe(receiver, "r", dst_blocks)
    runs = coalesce(src_blocks, dst_blocks)
    for layer in range(SHAPE[0]):
        sender.write(desc, layer, runs)
    sender.flush(desc)
    assert torch.equal(receiver.pool[:, :, dst_blocks], src[:, :, src_blocks])
    # 20 fragmented pages take the gather/scatter path: one copy per layer.
    expected = SHAPE[0] * (1 if len(runs) > ShmSender.MAX_RUNS_FOR_SLICE_COPIES else len(runs))
    assert sender.num_copies == expected
    receiver.leases.release("r")


def test_released_pages_refuse_writes(shm_pair):
    receiver, sender, src = shm_pair
    desc = describe(receiver, "r", [1, 2, 3])
    receiver.leases.release("r")
    before = receiver.pool.clone()
    with pytest.raises(StaleEpochError):
        sender.write(desc, 0, coalesce([5, 6, 7], [1, 2, 3]))
    with pytest.raises(StaleEpochError):
        sender.flush(desc)
    assert torch.equal(before, receiver.pool)
