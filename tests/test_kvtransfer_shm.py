"""The shm sender and the page copy under it: every copy strategy lands the same bytes, fencing holds."""
import random

import pytest
import torch

from splitserve.kvtransfer.base import KVLayout, StaleEpochError, TransferDescriptor, coalesce
from splitserve.kvtransfer import page_copy
from splitserve.kvtransfer.lease import LeaseTable, PageFence
from splitserve.kvtransfer.transports.shm import ShmReceiver, ShmSender, create_shared_pool, remove_pool_directory
from tests.kv_pools import QUANTIZED, random_pool

SHAPE = (3, 2, 64, 8, 2, 16)


@pytest.fixture(params=[torch.bfloat16, *QUANTIZED])
def shm_pair(request):
    src = random_pool(SHAPE, request.param)  # quantized pages: rows of 16 codes + a 4-byte scale
    pool, owners, directory = create_shared_pool(src.shape, src.dtype)
    receiver = ShmReceiver(pool, LeaseTable(PageFence(owners), ttl_s=60), directory)
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
    assert torch.equal(receiver.pool[:, :, dst_blocks].view(torch.uint8), src[:, :, src_blocks].view(torch.uint8))
    # The CPU page-copy kernel takes every layer's runs in one call.
    assert sender.num_copies == SHAPE[0]
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
    assert torch.equal(before.view(torch.uint8), receiver.pool.view(torch.uint8))


@pytest.mark.parametrize("native", [True, False], ids=["cpu-kernel", "gather-scatter"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, *QUANTIZED])
def test_page_copy_paths_agree(native, dtype, monkeypatch):
    """The C++ page copy (and the slice copies or gather/scatter used where it cannot be built) on
    one run, a few runs and a random page table of a strided layer view, as the shm sender hands them over."""
    from splitserve.engine.attention import cpu_kernels
    if native:
        assert cpu_kernels.available(), cpu_kernels.load_error()
    else:
        monkeypatch.setattr(page_copy, "_native_cpu", lambda: False)
    rng = random.Random(7)
    src_pool = random_pool(SHAPE, dtype)
    for src_blocks, dst_blocks in ((list(range(3, 13)), list(range(40, 50))),  # one run
                                   (rng.sample(range(64), 5), rng.sample(range(64), 5)),  # slice copies
                                   (rng.sample(range(64), 30), rng.sample(range(64), 30))):  # one gathered copy
        dst_pool = torch.zeros(src_pool.shape, dtype=src_pool.dtype)
        runs = coalesce(src_blocks, dst_blocks)
        assert page_copy.copy_runs(src_pool[1], dst_pool[1], runs) == \
            (1 if native or len(runs) > page_copy.MAX_RUNS_FOR_SLICE_COPIES else len(runs))
        expected = torch.zeros(src_pool.shape, dtype=src_pool.dtype)
        expected[1][:, dst_blocks] = src_pool[1][:, src_blocks]
        assert torch.equal(dst_pool.view(torch.uint8), expected.view(torch.uint8))  # other layers and pages untouched


def test_page_copy_kernel_refuses_pages_outside_the_pools():
    from splitserve.engine.attention import cpu_kernels
    assert cpu_kernels.available(), cpu_kernels.load_error()
    src, dst = torch.zeros(2, 4, 8), torch.zeros(2, 4, 8)
    with pytest.raises(RuntimeError, match="outside the pools"):
        torch.ops.splitserve_cpu.copy_pages(src, dst, torch.tensor([0, 1]), torch.tensor([3, 4]))
    with pytest.raises(RuntimeError, match="dtypes differ"):
        torch.ops.splitserve_cpu.copy_pages(src, dst.double(), torch.tensor([0]), torch.tensor([1]))


def _resident_bytes(path) -> int:
    """Rss of this process's mappings of ``path`` (/proc/self/smaps)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = fields[-1] == str(path)
            elif inside and fields[0] == "Rss:":
                rss += int(fields[1]) * 1024
    return rss


def test_shared_pool_is_taken_and_mapped_at_creation():
    # A first write into an unmapped page cost a prefill step its allocation; here the pool's
    # memory is allocated (fallocate) and mapped (touched) before any request.
    shape = (2, 2, 64, 4, 16, 16)
    pool, owners, directory = create_shared_pool(shape, torch.bfloat16)
    try:
        nbytes = pool.numel() * pool.element_size()
        assert (directory / "pool").stat().st_blocks * 512 >= nbytes
        assert _resident_bytes(directory / "pool") >= nbytes
        assert not pool.any()
        assert oct((directory / "pool").stat().st_mode & 0o777) == oct(0o600)
    finally:
        remove_pool_directory(directory)


def test_shared_pool_that_does_not_fit_is_a_clear_error(monkeypatch):
    import errno
    import os
    from splitserve.common.locality import POOL_PREFIX, pool_root

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)  # what a container's 64 MB /dev/shm answers
    before = set(pool_root().glob(f"{POOL_PREFIX}{os.getpid()}-*"))
    with pytest.raises(OSError, match="shm-size.*kv-cache-memory-gb"):
        create_shared_pool((2, 2, 64, 4, 16, 16), torch.bfloat16)
    assert set(pool_root().glob(f"{POOL_PREFIX}{os.getpid()}-*")) == before  # nothing left behind
