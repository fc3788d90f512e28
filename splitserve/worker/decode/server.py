"""Wiring of a decode worker process (``splitserve decode``): engine, KV receiver, servicer, runtime."""
from __future__ import annotations

import uuid

from splitserve.worker.serve import engine_config, run_worker, worker_security


def serve(args) -> int:
    security = worker_security(args)  # a refused security configuration stops here, before the model loads
    from splitserve.worker.decode.servicer import DecodeWorkerServicer
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.worker.wiring import build_decode
    from splitserve.common.metrics import EngineMetrics, public_model_name, serve_metrics
    from splitserve.common.tracing import setup as setup_tracing
    from splitserve.v1 import worker_pb2_grpc
    config = engine_config(args)
    registry, metrics_address = serve_metrics(args.metrics_port, args.host,
                                              model_name=public_model_name(args.model))
    metrics = EngineMetrics(registry, args.role)
    worker_id = args.worker_id or f"{args.role}-{uuid.uuid4().hex[:8]}"
    setup_tracing(args.role, worker_id)
    if args.role == "both":
        servicer = DecodeWorkerServicer(LLMEngine(config), None, worker_id, metrics,
                                        engine_niceness=args.engine_niceness,
                                        bind_threads=not args.no_thread_binding)
    else:
        connector = build_decode(config, args.kv_transport, lease_ttl_s=args.lease_ttl_s, host=args.host,
                                 advertise_host=args.advertise_host or None, kv_key=security.kv_key)
        servicer = DecodeWorkerServicer(connector.engine, connector, worker_id, metrics,
                                        engine_niceness=args.engine_niceness,
                                        bind_threads=not args.no_thread_binding)
    servicer.metrics_address = metrics_address
    return run_worker(servicer, worker_pb2_grpc.add_DecodeWorkerServicer_to_server, "splitserve.v1.DecodeWorker",
                      args)
