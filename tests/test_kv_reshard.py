"""KV re-sharded by head between a prefill and a decode engine split over different numbers of
tensor-parallel ranks (splitserve/kvtransfer/head_map.py), on CPU (gloo ranks, shm pools).

1 -> 2, 2 -> 1 and 2 -> 4: the decode side's greedy output equals transformers only if every
decode rank got every head it owns from the right prefill rank (a rank attends over its own heads
only); chunked prefill ships pages over several steps; the decode rank 0 checksum is checked where
it can be computed (decode rank 0's heads all on prefill rank 0); over shm (a head range copied
into the mapped pool) and tcp (HEADS frames). A pair that can only talk nccl is refused before a
byte moves; so is one whose heads differ in all. The served path, with ``up``'s
per-role flags: tests/faults/test_tensor_parallel_service.py.
"""
import pytest
import torch

from splitserve.kvtransfer import LayoutMismatchError
from splitserve.kvtransfer.base import KVLayout
from splitserve.kvtransfer.head_map import HeadSlice, Route, routes
from tests.harness.tiny_models import make_tiny_model
from tests.test_engine_correctness import mixed_prompts
from tests.test_kvtransfer_handoff import handoff
from tests.test_tensor_parallel import GREEDY, config, connected


def test_routes_cover_every_head_once():
    assert routes(4, 2, 1, 2) == [Route(1, None)]  # split alike: rank to rank, whole pages
    assert routes(2, 1, 0, 2) == [Route(0, HeadSlice(0, 0, 1)), Route(1, HeadSlice(1, 0, 1))]
    assert routes(2, 2, 1, 1) == [Route(0, HeadSlice(0, 1, 1))]
    assert routes(8, 4, 1, 2) == [Route(0, HeadSlice(0, 2, 2))]
    assert routes(8, 2, 1, 4) == [Route(2, HeadSlice(0, 0, 2)), Route(3, HeadSlice(2, 0, 2))]
    for total, a, b in [(8, 1, 4), (8, 4, 1), (8, 2, 8), (12, 3, 2), (12, 2, 3)]:
        landed = {}
        for rank in range(a):
            for route in routes(total, a, rank, b):
                h = route.heads
                for i in range(h.count):
                    source = rank * (total // a) + h.src_start + i
                    target = route.dst_rank * (total // b) + h.dst_start + i
                    assert target not in landed
                    landed[target] = source
        assert landed == {h: h for h in range(total)}, (total, a, b)
    with pytest.raises(LayoutMismatchError, match="cannot be split over the decode worker's 3 ranks"):
        routes(4, 2, 0, 3)


def test_reshardable_layouts_are_the_same_heads_in_all():
    one = KVLayout("m", 2, 4, 16, 8, "float32", tensor_parallel_size=1, page_order="head_major")
    two = KVLayout("m", 2, 2, 16, 8, "float32", tensor_parallel_size=2, page_order="head_major")
    one.check_reshardable(two)
    with pytest.raises(LayoutMismatchError, match="KV heads in all: 4 here vs 6 on the peer"):
        one.check_reshardable(KVLayout("m", 2, 3, 16, 8, "float32", tensor_parallel_size=2))
    with pytest.raises(LayoutMismatchError, match="head_dim"):
        one.check_reshardable(KVLayout("m", 2, 2, 8, 8, "float32", tensor_parallel_size=2))


@pytest.fixture(scope="module")
def four_kv_heads(tmp_path_factory):
    """A tiny Llama with 4 KV heads (8 query heads): splits over 1, 2 and 4 ranks."""
    return make_tiny_model(tmp_path_factory.mktemp("kv4") / "llama", arch="llama", num_heads=8, num_kv_heads=4,
                           head_dim=8)


# 2 -> 4 over shm only: six rank processes on two cores are the suite's slowest handoff, and tcp's
# head ranges (a destination head offset included) are covered by 2 -> 1.
@pytest.mark.parametrize("prefill_tp, decode_tp, transport", [(1, 2, "shm"), (1, 2, "tcp"), (2, 1, "shm"),
                                                              (2, 1, "tcp"), (2, 4, "shm")])
def test_differently_split_workers_hand_off_exactly(prefill_tp, decode_tp, transport, four_kv_heads, hf_reference,
                                                    private_shm):
    with connected(config(four_kv_heads, tensor_parallel_size=decode_tp), transport,
                   config(four_kv_heads, tensor_parallel_size=prefill_tp, max_num_batched_tokens=24),
                   verify_checksum=True) as (prefill, decode):
        prompts = mixed_prompts(3, seed=prefill_tp * 10 + decode_tp, lo=3, hi=45)
        outputs, _ = handoff(prefill, decode, prompts)
        ref = hf_reference(four_kv_heads)
        assert [o.token_ids for o in outputs] == [ref.greedy(p, 8) for p in prompts]
        prefill.engine.assert_idle()
        decode.engine.assert_idle()
        assert len(decode.leases) == 0
    assert not list(private_shm.iterdir())  # every rank's pool removed


def test_a_checksum_is_sent_where_decode_rank_0_holds_only_prefill_rank_0s_heads(four_kv_heads, private_shm):
    """1 -> 2: decode rank 0's heads are all on prefill rank 0, so its checksum goes with the first
    token and ``complete`` checks it. (2 -> 1, where decode rank 0 also holds prefill rank 1's heads,
    sends none: a checksum there would fail ``complete`` in the hand-off test above.)"""
    with connected(config(four_kv_heads, tensor_parallel_size=2), "shm",
                   config(four_kv_heads), verify_checksum=True) as (prefill, decode):
        prompt = list(range(3, 30))
        desc = decode.reserve("c0", len(prompt))
        prefill.start("c0", prompt, GREEDY, desc)
        results = []
        while not results:
            results = prefill.step()
        assert results[0].error is None and results[0].checksum is not None
        decode.complete("c0", results[0].epoch, prompt, GREEDY, results[0].first_token, checksum=results[0].checksum)
        assert decode.abort("c0")


def test_resharding_over_nccl_is_refused_before_a_byte_moves(four_kv_heads):
    """nccl moves whole pages (and tensor-parallel workers never use it for KV)."""
    with connected(config(four_kv_heads), "nccl",
                   config(four_kv_heads, tensor_parallel_size=2)) as (prefill, decode):
        desc = decode.reserve("r0", 10)
        before = decode.engine.runner.kv_cache.clone()
        with pytest.raises(LayoutMismatchError, match="re-sharded by head over shm, cuda_ipc, tcp only, and the "
                                                      "decode worker offers nccl"):
            prefill.start("r0", list(range(10)), GREEDY, desc)
        for _ in range(3):
            assert prefill.step() == []
        assert torch.equal(decode.engine.runner.kv_cache, before)
        prefill.engine.assert_idle()
        assert decode.abort("r0")
        decode.engine.assert_idle()
