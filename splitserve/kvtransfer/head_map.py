"""KV re-sharded by head between workers split over different numbers of tensor-parallel ranks.

A pool split over ``tp`` ranks gives rank r the KV heads ``[r * H / tp, (r + 1) * H / tp)`` of the
model's ``H``. A prefill worker of ``A`` ranks and a decode worker of ``B`` ranks (``--prefill-
tensor-parallel-size A --decode-tensor-parallel-size B``: prefill wants ranks for compute, decode
for KV memory) exchange KV as head ranges: each prefill rank sends, to every decode rank whose
range meets its own, the heads they share (1 -> 2: rank 0 sends its first half to decode rank 0
and its second to rank 1; 2 -> 1: both ranks send to decode rank 0, each to its place). Same A
and B: rank r to rank r, whole pages (``routes`` gives one route without a slice).

The transports that write part of a page (``RESHARD_TRANSPORTS``): shm and cuda_ipc copy a head
range into the mapped pool; tcp sends it in HEADS frames (``transports/tcp.py``). nccl, which
tensor-parallel workers do not use for KV at all, is refused before any byte moves.
"""
from __future__ import annotations

from dataclasses import dataclass

from splitserve.kvtransfer.base import KVLayout, LayoutMismatchError, TransferDescriptor

RESHARD_TRANSPORTS = ("shm", "cuda_ipc", "tcp")


@dataclass(frozen=True)
class HeadSlice:
    """``count`` KV heads from index ``src_start`` of a source rank's pages to ``dst_start`` of a
    destination rank's (indices within each rank's own heads)."""
    src_start: int
    dst_start: int
    count: int


@dataclass(frozen=True)
class Route:
    """Where one prefill rank's KV goes: decode rank ``dst_rank``, all of it (``heads`` None) or a slice."""
    dst_rank: int
    heads: HeadSlice | None


def routes(total_heads: int, src_tp: int, src_rank: int, dst_tp: int) -> list[Route]:
    """The decode ranks prefill rank ``src_rank`` of ``src_tp`` writes, and which of its heads to each."""
    if src_tp == dst_tp:
        return [Route(src_rank, None)]
    for name, tp in (("prefill", src_tp), ("decode", dst_tp)):
        if tp < 1 or total_heads % tp:
            raise LayoutMismatchError(f"{total_heads} KV heads cannot be split over the {name} worker's {tp} ranks")
    src_n, dst_n = total_heads // src_tp, total_heads // dst_tp
    lo, hi = src_rank * src_n, (src_rank + 1) * src_n
    out = []
    for dst in range(lo // dst_n, (hi - 1) // dst_n + 1):
        start, end = max(lo, dst * dst_n), min(hi, (dst + 1) * dst_n)
        out.append(Route(dst, HeadSlice(start - lo, start - dst * dst_n, end - start)))
    return out


def rank_descriptor(desc: TransferDescriptor, rank: int, transport: str) -> TransferDescriptor:
    """``desc`` as decode rank ``rank`` takes it: that rank's address of ``transport``."""
    import dataclasses

    from splitserve.kvtransfer.base import TransportUnavailableError
    if rank == 0:
        offers = dict(desc.offers)
    elif rank - 1 < len(desc.rank_offers):
        offers = dict(desc.rank_offers[rank - 1])
    else:
        raise TransportUnavailableError(f"request {desc.request_id!r}: the descriptor offers no decode rank {rank}")
    if transport not in offers:
        raise TransportUnavailableError(f"decode rank {rank} offers no {transport} for request {desc.request_id!r}")
    return dataclasses.replace(desc, transport=transport, address=offers[transport], alternatives=(), rank_offers=())


def check_pair(mine: KVLayout, theirs: KVLayout) -> bool:
    """Raise unless this prefill pool can fill ``theirs``; True when that takes re-sharding."""
    if mine.tensor_parallel_size == theirs.tensor_parallel_size:
        mine.check_compatible(theirs)
        return False
    mine.check_reshardable(theirs)
    return True
