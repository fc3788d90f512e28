"""Head-major CPU pages (splitserve/engine/attention/page_order.py): the token view over them, the runner's
pool, the layout descriptor, and transports that move the pages as bytes."""
import math

import pytest
import torch

from splitserve.engine.attention.page_order import (HEAD_MAJOR, TOKEN_MAJOR, order_of, page_order_for, page_shape, pages_of,
                                         token_view)
from splitserve.kvtransfer.base import KVLayout, LayoutMismatchError, TransferDescriptor, coalesce
from splitserve.kvtransfer.lease import LeaseTable, PageFence
from splitserve.kvtransfer.transports.shm import ShmReceiver, ShmSender, create_shared_pool
from splitserve.kvtransfer.transports.tcp import TcpReceiver
from splitserve.kvtransfer.transports.tcp_sender import TcpSender
from tests.kv_pools import random_pool

LAYERS, BLOCKS, BS, HEADS, ROW = 2, 6, 4, 3, 8


@pytest.mark.parametrize("order", [TOKEN_MAJOR, HEAD_MAJOR])
def test_the_token_view_indexes_tokens_and_pages_of_gives_the_memory_back(order):
    shape = page_shape(order, LAYERS, BLOCKS, BS, HEADS, ROW)
    pages = torch.arange(math.prod(shape)).view(shape)
    view = token_view(pages, order)
    assert view.shape == (LAYERS, 2, BLOCKS, BS, HEADS, ROW)
    assert order_of(view) == order
    back = pages_of(view)
    assert back.is_contiguous() and back.data_ptr() == pages.data_ptr() and torch.equal(back, pages)
    # Layer 1, V, block 4, token 3, head 2: where its row starts in memory.
    page = ((1 * 2 + 1) * BLOCKS + 4) * BS * HEADS * ROW
    within = (2 * BS + 3) * ROW if order == HEAD_MAJOR else (3 * HEADS + 2) * ROW
    assert view[1, 1, 4, 3, 2, 0].item() == page + within


def test_cpu_pools_are_head_major_unless_the_orders_are_the_same_bytes():
    assert page_order_for("cpu", 16, 3) == HEAD_MAJOR
    assert page_order_for("cuda", 16, 3) == TOKEN_MAJOR  # the Triton kernels' layout
    # One KV head (a tensor-parallel rank's share, say): [16, 1, D] and [1, 16, D] are the same
    # bytes, and order_of reads such a view back as token-major: both sides agree.
    assert page_order_for("cpu", 16, 1) == TOKEN_MAJOR
    one_head = token_view(torch.zeros(page_shape(HEAD_MAJOR, 1, 2, 16, 1, 8)), HEAD_MAJOR)
    assert order_of(one_head) == TOKEN_MAJOR


def test_the_engine_pool_on_cpu_is_head_major(make_llm, tiny_model_dirs):
    runner = make_llm(tiny_model_dirs["llama"], block_size=8, num_gpu_blocks=16).engine.runner
    assert runner.page_order == HEAD_MAJOR and runner.num_kv_heads == 2
    assert runner.kv_pages.is_contiguous() and runner.kv_pages.shape[3:5] == (2, 8)
    assert order_of(runner.kv_cache) == HEAD_MAJOR and runner.kv_cache.shape[3:5] == (8, 2)
    assert runner.kv_cache.data_ptr() == runner.kv_pages.data_ptr()
    assert KVLayout.of_pool("m", runner.kv_cache).page_order == HEAD_MAJOR


def head_major_pool(seed: int) -> torch.Tensor:
    """A random pool in head-major memory, as its token view (what the runner hands kvtransfer)."""
    torch.manual_seed(seed)
    return token_view(random_pool(page_shape(HEAD_MAJOR, LAYERS, BLOCKS, BS, HEADS, ROW), torch.float32), HEAD_MAJOR)


def test_head_major_and_token_major_pages_never_mix():
    head = KVLayout.of_pool("m", head_major_pool(0))
    token = KVLayout.of_pool("m", torch.zeros(LAYERS, 2, BLOCKS, BS, HEADS, ROW))
    assert (head.page_order, token.page_order) == (HEAD_MAJOR, TOKEN_MAJOR)
    with pytest.raises(LayoutMismatchError, match="page_order"):
        head.check_compatible(token)


def land(sender, receiver, dst_view, rid, src_blocks, dst_blocks) -> TransferDescriptor:
    lease = receiver.leases.grant(rid, dst_blocks)
    desc = TransferDescriptor(rid, receiver.name, receiver.address, tuple(dst_blocks),
                              KVLayout.of_pool("m", dst_view), lease.epoch, lease.deadline)
    runs = coalesce(src_blocks, dst_blocks)
    for layer in range(LAYERS):
        sender.write(desc, layer, runs)
    sender.flush(desc)
    return desc


SRC_BLOCKS, DST_BLOCKS = [0, 1, 4], [5, 2, 3]


def test_shm_moves_head_major_pages_whole():
    src = head_major_pool(1)
    pages, owners, directory = create_shared_pool(page_shape(HEAD_MAJOR, LAYERS, BLOCKS, BS, HEADS, ROW), src.dtype)
    dst = token_view(pages, HEAD_MAJOR)
    receiver = ShmReceiver(dst, LeaseTable(PageFence(owners), ttl_s=60), directory)
    try:
        land(ShmSender(receiver.address, src), receiver, dst, "r", SRC_BLOCKS, DST_BLOCKS)
        # Read back through the token view: each token's every head where the source had it.
        assert torch.equal(dst[:, :, DST_BLOCKS], src[:, :, SRC_BLOCKS])
    finally:
        receiver.close()


def test_tcp_moves_head_major_pages_whole_without_staging():
    src, dst = head_major_pool(2), token_view(torch.zeros(page_shape(HEAD_MAJOR, LAYERS, BLOCKS, BS, HEADS, ROW)),
                                             HEAD_MAJOR)
    receiver = TcpReceiver(dst, LeaseTable(PageFence(torch.empty(BLOCKS, dtype=torch.int64)), ttl_s=60))
    sender = TcpSender(receiver.address, src)
    try:
        # Both ends see their pool as contiguous pages: received straight into the pool's bytes.
        assert receiver._flat is not None and sender._flat is not None
        land(sender, receiver, dst, "r", SRC_BLOCKS, DST_BLOCKS)
        assert torch.equal(dst[:, :, DST_BLOCKS], src[:, :, SRC_BLOCKS])
        # A token-major descriptor (a GPU decode worker's, say) is refused before a byte moves.
        token = torch.zeros(LAYERS, 2, BLOCKS, BS, HEADS, ROW)
        lease = receiver.leases.grant("t", [0])
        with pytest.raises(LayoutMismatchError, match="page_order"):
            sender.write(TransferDescriptor("t", "tcp", receiver.address, (0,), KVLayout.of_pool("m", token),
                                            lease.epoch, lease.deadline), 0, [(0, 0, 1)])
    finally:
        sender.close()
        receiver.close()
