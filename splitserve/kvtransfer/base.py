"""Contracts shared by both sides of a KV handoff: layout, descriptor, errors, page runs, checksums.

A decode worker *reserves* pages for a request and describes them in a ``TransferDescriptor``
(transport address, page ids, layout, epoch, lease deadline). The prefill worker checks the
layout against its own before any byte moves, writes the request's KV into those pages layer
by layer, flushes, and reports completion with the epoch. The epoch is a fencing token: a
write or a completion that carries an older epoch than the lease's current one is refused.
"""
from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, fields
from typing import Sequence

import grpc
import torch

from splitserve.common.errors import SplitserveError
from splitserve.engine.attention import kv_quant
from splitserve.engine.attention.page_order import TOKEN_MAJOR, order_of


class TransferError(SplitserveError):
    """A KV handoff failed; the message says why and what to do. The handoff is void: a client
    sees UNAVAILABLE (retry it)."""

    code = grpc.StatusCode.UNAVAILABLE


class LayoutMismatchError(TransferError):
    """The two pools cannot exchange pages (heads, head size, dtype, page size differ): retrying
    the same pair cannot help."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StaleEpochError(TransferError):
    pass


class LeaseExpiredError(TransferError):
    pass


class TransferAbortedError(TransferError):
    pass


class ChecksumMismatchError(TransferError):
    pass


class TransportUnavailableError(TransferError):
    pass


@dataclass(frozen=True)
class KVLayout:
    """Everything that must match for pages to mean the same thing on both sides."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # torch dtype name of the pool without the "torch." prefix, e.g. "bfloat16", "int8"
    # "auto" (pages in the model dtype) or the quantized format of the pages: "int8", "fp8_e4m3",
    # "fp8_e5m2" (splitserve/engine/attention/kv_quant.py; "fp8" is named fp8_e4m3 here).
    kv_cache_dtype: str = "auto"
    # Where a quantized page keeps its scales ("" when unquantized): kv_quant.SCALE_LAYOUT.
    kv_scales: str = ""
    # Ranks the pool is split over (num_kv_heads is one rank's share, rank r holding heads
    # [r * num_kv_heads, (r + 1) * num_kv_heads)): split alike, rank r of the prefill worker writes
    # into rank r of the decode worker; split otherwise, KV is re-sharded by head (head_map.py).
    tensor_parallel_size: int = 1
    # How a page lies in memory (splitserve/engine/attention/page_order.py): pages move as raw bytes, so a
    # head-major CPU pool and a token-major GPU pool cannot exchange them.
    page_order: str = TOKEN_MAJOR

    def check_compatible(self, other: "KVLayout") -> None:
        diffs = [f"{f.name}: {getattr(self, f.name)!r} here vs {getattr(other, f.name)!r} on the peer"
                 for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]
        if diffs:
            raise LayoutMismatchError("KV layout mismatch, no bytes moved; run both workers with the same "
                                      "model, block size, dtype, kv-cache-dtype and tensor-parallel-size on the same kind "
                                      "of device ("
                                      + "; ".join(diffs) + ")")

    @property
    def total_kv_heads(self) -> int:
        return self.num_kv_heads * self.tensor_parallel_size

    def check_reshardable(self, other: "KVLayout") -> None:
        """Raise LayoutMismatchError unless pages of this pool can be re-sharded by head into
        ``other``'s (split over another number of ranks): the same model, pages and dtype, and the
        same KV heads in all. Each side's page order may differ (it is read per pool)."""
        loose = ("num_kv_heads", "tensor_parallel_size", "page_order")
        diffs = [f"{f.name}: {getattr(self, f.name)!r} here vs {getattr(other, f.name)!r} on the peer"
                 for f in fields(self) if f.name not in loose and getattr(self, f.name) != getattr(other, f.name)]
        if self.total_kv_heads != other.total_kv_heads:
            diffs.append(f"KV heads in all: {self.total_kv_heads} here vs {other.total_kv_heads} on the peer")
        if diffs:
            raise LayoutMismatchError("KV layout mismatch, no bytes moved; run both workers with the same model, "
                                      "block size, dtype and kv-cache-dtype (" + "; ".join(diffs) + ")")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V), a quantized page's scales included."""
        row = kv_quant.row_width(self.head_dim, kv_quant.of_storage(self.torch_dtype))
        return self.block_size * self.num_kv_heads * row * torch.empty((), dtype=self.torch_dtype).element_size()

    @classmethod
    def of_pool(cls, model: str, pool: torch.Tensor, tensor_parallel_size: int = 1) -> "KVLayout":
        """Layout of a pool tensor shaped [layers, 2, blocks, block_size, kv_heads, head_dim] (one
        rank's, of ``tensor_parallel_size``); its strides say the page order (``page_order.order_of``)."""
        layers, two, _, block_size, kv_heads, _ = pool.shape
        if two != 2:
            raise ValueError(f"a KV pool is [layers, 2, blocks, block_size, kv_heads, head_dim], got {tuple(pool.shape)}")
        # A quantized pool says so by its dtype (kv_quant): its rows are head_dim codes + a scale.
        quant = kv_quant.of_storage(pool.dtype)
        return cls(model, layers, kv_heads, kv_quant.head_dim_of(pool), block_size,
                   str(pool.dtype).removeprefix("torch."), quant.name if quant else "auto",
                   kv_quant.SCALE_LAYOUT if quant else "", tensor_parallel_size, order_of(pool))


@dataclass(frozen=True)
class TransferDescriptor:
    """What a decode worker hands out for one request's reserved pages."""

    request_id: str
    transport: str
    address: str
    block_ids: tuple[int, ...]
    layout: KVLayout
    epoch: int
    lease_deadline: float  # time.time() seconds
    # Further (transport, address) pairs the same pages accept, slower ones last; the prefill
    # side takes the first offer it supports and can reach.
    alternatives: tuple[tuple[str, str], ...] = ()
    # The first pages of ``block_ids`` that already hold the prompt's KV on the decode side (its
    # prefix cache, maybe shared with other requests): nobody writes them, no lease covers them.
    num_cached_blocks: int = 0
    # Tensor-parallel decode workers: the offers of ranks 1..N-1 (rank 0's are above), each in the
    # order of ``offers``; prefill rank r writes its slice through its entry r-1.
    rank_offers: tuple[tuple[tuple[str, str], ...], ...] = ()

    @property
    def written_block_ids(self) -> tuple[int, ...]:
        """The pages the transfer fills (and the lease fences)."""
        return self.block_ids[self.num_cached_blocks:]

    @property
    def offers(self) -> tuple[tuple[str, str], ...]:
        return ((self.transport, self.address),) + self.alternatives

    def to_dict(self) -> dict:
        d = asdict(self)
        d["block_ids"] = list(self.block_ids)
        d["alternatives"] = [list(a) for a in self.alternatives]
        d["rank_offers"] = [[list(o) for o in offers] for offers in self.rank_offers]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TransferDescriptor":
        return cls(request_id=str(d["request_id"]), transport=str(d["transport"]), address=str(d["address"]),
                   block_ids=tuple(int(b) for b in d["block_ids"]), layout=KVLayout(**d["layout"]),
                   epoch=int(d["epoch"]), lease_deadline=float(d["lease_deadline"]),
                   alternatives=tuple((str(t), str(a)) for t, a in d.get("alternatives", ())),
                   num_cached_blocks=int(d.get("num_cached_blocks", 0)),
                   rank_offers=tuple(tuple((str(t), str(a)) for t, a in offers) for offers in d.get("rank_offers", ())))

    # How it travels to the other tensor-parallel ranks (splitserve.engine.tensor_parallel.messages).
    to_wire = to_dict
    from_wire = from_dict


def coalesce(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs (src_start, dst_start, length) where both sides' block ids are consecutive.

    A run moves as one copy; fragmented tables degrade to one copy per page, contiguous ones
    to a single copy per layer.
    """
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source pages for {len(dst_blocks)} destination pages")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_blocks, dst_blocks):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def kv_checksum(pool: torch.Tensor, block_ids: Sequence[int], num_tokens: int) -> int:
    """CRC32 of the KV of the first ``num_tokens`` token slots of a request, every layer, K then V.

    Computed the same way over the prefill pages and the decode pages, so equal bytes give an
    equal checksum whatever the page ids; slots past ``num_tokens`` (stale data) do not count.
    The pages are gathered where the pool lives (CPU or GPU) and only they come to the host.
    """
    block_size = pool.shape[3]
    full, tail = divmod(num_tokens, block_size)
    index = torch.tensor(list(block_ids[:full + (1 if tail else 0)]), dtype=torch.long, device=pool.device)
    pages = pool.index_select(2, index)  # [L, 2, n, bs, H, D]
    parts = [pages[:, :, :full], pages[:, :, full:, :tail]] if tail else [pages]
    crc = 0
    for part in parts:
        crc = zlib.crc32(part.contiguous().view(torch.uint8).cpu().numpy(), crc)
    return crc
