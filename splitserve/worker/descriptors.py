"""KV transfer descriptors on the worker API: ``splitserve.kvtransfer.base.TransferDescriptor`` <->
``worker_pb2.TransferDescriptor``. The decode worker writes them (its reservation), the prefill
worker reads them (where to write); the gateway passes them through untouched, so this lives
with the workers (``splitserve.wire`` holds the conversions the gateway makes too).
"""
from __future__ import annotations

from splitserve.common.errors import InvalidArgument
from splitserve.engine.attention.page_order import TOKEN_MAJOR
from splitserve.kvtransfer.base import KVLayout, TransferDescriptor
from splitserve.v1 import worker_pb2


def descriptor_to_proto(desc: TransferDescriptor) -> worker_pb2.TransferDescriptor:
    """``splitserve.kvtransfer.base.TransferDescriptor`` -> proto."""
    layout = desc.layout
    return worker_pb2.TransferDescriptor(
        request_id=desc.request_id,
        transport=desc.transport,
        address=desc.address,
        block_ids=list(desc.block_ids),
        layout=worker_pb2.KVLayout(model=layout.model, num_layers=layout.num_layers,
                                   num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                                   block_size=layout.block_size, dtype=layout.dtype,
                                   kv_cache_dtype=layout.kv_cache_dtype, kv_scales=layout.kv_scales,
                                   tensor_parallel_size=layout.tensor_parallel_size,
                                   page_order=layout.page_order),
        epoch=desc.epoch,
        lease_deadline=desc.lease_deadline,
        alternatives=[worker_pb2.TransportOffer(transport=t, address=a) for t, a in desc.alternatives],
        num_cached_blocks=desc.num_cached_blocks,
        rank_offers=[worker_pb2.RankOffers(offers=[worker_pb2.TransportOffer(transport=t, address=a) for t, a in offers])
                     for offers in desc.rank_offers],
    )


def descriptor_from_proto(msg: worker_pb2.TransferDescriptor, field: str = "descriptor") -> TransferDescriptor:
    """Proto -> ``splitserve.kvtransfer.base.TransferDescriptor``; ``InvalidArgument`` when incomplete."""
    for name in ("request_id", "transport", "address"):
        if not getattr(msg, name):
            raise InvalidArgument(f"{field}.{name} must be set")
    if not msg.HasField("layout"):
        raise InvalidArgument(f"{field}.layout must be set")
    if not msg.block_ids:
        raise InvalidArgument(f"{field}.block_ids must not be empty")
    if msg.num_cached_blocks >= len(msg.block_ids):
        raise InvalidArgument(f"{field}.num_cached_blocks ({msg.num_cached_blocks}) must be less than the "
                              f"{len(msg.block_ids)} pages (the prompt's last page is always written)")
    lay = msg.layout
    layout = KVLayout(model=lay.model, num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads,
                      head_dim=lay.head_dim, block_size=lay.block_size, dtype=lay.dtype,
                      kv_cache_dtype=lay.kv_cache_dtype or "auto", kv_scales=lay.kv_scales,
                      tensor_parallel_size=lay.tensor_parallel_size or 1,
                      page_order=lay.page_order or TOKEN_MAJOR)
    return TransferDescriptor(
        request_id=msg.request_id,
        transport=msg.transport,
        address=msg.address,
        block_ids=tuple(msg.block_ids),
        layout=layout,
        epoch=msg.epoch,
        lease_deadline=msg.lease_deadline,
        alternatives=tuple((o.transport, o.address) for o in msg.alternatives),
        num_cached_blocks=msg.num_cached_blocks,
        rank_offers=tuple(tuple((o.transport, o.address) for o in r.offers) for r in msg.rank_offers),
    )
