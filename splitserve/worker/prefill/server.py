"""Wiring of a prefill worker process (``splitserve prefill``): engine, KV senders, servicer, runtime."""
from __future__ import annotations

import dataclasses
import uuid

from splitserve.worker.serve import engine_config, run_worker, worker_security


def serve(args) -> int:
    security = worker_security(args)  # a refused security configuration stops here, before the model loads
    from splitserve.kvtransfer import TRANSPORTS
    from splitserve.worker.wiring import build_prefill
    from splitserve.worker.prefill.servicer import PrefillWorkerServicer
    from splitserve.common.metrics import EngineMetrics, TransferMetrics, public_model_name, serve_metrics
    from splitserve.common.tracing import setup as setup_tracing
    from splitserve.v1 import worker_pb2_grpc
    transports = TRANSPORTS if args.kv_transport == "auto" else [t.strip() for t in args.kv_transport.split(",")]
    # A prefill worker samples one token per request: speculation (and a draft model) would be dead weight.
    config = dataclasses.replace(engine_config(args), speculative_method=None, speculative_model=None)
    connector = build_prefill(config, transports, verify_checksum=args.verify_checksum, kv_key=security.kv_key)
    registry, metrics_address = serve_metrics(args.metrics_port, args.host,
                                              model_name=public_model_name(args.model))
    worker_id = args.worker_id or f"prefill-{uuid.uuid4().hex[:8]}"
    setup_tracing("prefill", worker_id)
    servicer = PrefillWorkerServicer(connector, worker_id, EngineMetrics(registry, "prefill"),
                                     TransferMetrics(registry, sorted(connector.sender_factories)),
                                     engine_niceness=args.engine_niceness,
                                     bind_threads=not args.no_thread_binding)
    servicer.metrics_address = metrics_address
    return run_worker(servicer, worker_pb2_grpc.add_PrefillWorkerServicer_to_server, "splitserve.v1.PrefillWorker",
                      args)
