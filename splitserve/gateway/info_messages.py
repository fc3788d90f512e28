"""The messages of the Generation service's read-only RPCs, built from what Redis keeps.

``GetRequest`` answers with a request's record (``request_info``); ``GetServerInfo`` with the
queue and the workers (``server_info``), where only the admin learns addresses: anyone else
learns roles and load, not where to connect.
"""
from __future__ import annotations

import json

from google.protobuf import json_format

from splitserve.v1 import generation_pb2


def request_info(shown_id: str, record: dict) -> generation_pb2.RequestInfo:
    """A request's Redis record (``RequestStore.get``) as the client sees it, under the id the
    client gave (``shown_id``), not the scoped one."""
    timeline = record.get("timeline")
    if isinstance(timeline, str):
        timeline = json.loads(timeline)
    return generation_pb2.RequestInfo(request_id=shown_id, state=str(record.get("state", "")),
                                      priority=int(record.get("priority", 0)), attempt=int(record.get("attempt", 0)),
                                      finish_reason=str(record.get("finish_reason", "")),
                                      error=str(record.get("error", "")),
                                      timeline=json_format.ParseDict(timeline or {}, generation_pb2.Timeline()))


def server_info(queue_depth: int, gateway_id: str, gateway_metrics_address: str, workers,
                admin: bool) -> generation_pb2.ServerInfo:
    """The queue depth, this gateway, then every registered worker (``WorkerView``s); addresses
    only for the ``admin``."""
    info = generation_pb2.ServerInfo(queue_depth=queue_depth)
    info.workers.add(worker_id=gateway_id, role="gateway", metrics_address=gateway_metrics_address if admin else "")
    for w in workers:
        info.workers.add(worker_id=w.worker_id, role=w.role, address=w.address if admin else "",
                         transports=w.transports, kv_blocks_total=w.kv_blocks_total,
                         kv_blocks_free=w.kv_blocks_free, kv_blocks_cached=w.kv_blocks_cached,
                         num_running=w.num_running, num_waiting=w.num_waiting, loras=sorted(w.loras),
                         metrics_address=w.metrics_address if admin else "")
    return info
