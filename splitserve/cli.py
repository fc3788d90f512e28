"""The ``splitserve`` command: one subcommand per process kind.

Every flag can also come from the environment (``SPLITSERVE_<FLAG>``, e.g.
``SPLITSERVE_MODEL``), so compose files configure services without long command lines.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import signal
import threading
import time
import uuid

log = logging.getLogger("splitserve")


def _env(name: str, default):
    value = os.environ.get(f"SPLITSERVE_{name.upper()}")
    if value is None:
        return default
    return type(default)(value) if default is not None and not isinstance(default, bool) else value


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=_env("model", "smollm2-135m-instruct"),
                   help="model alias or local Hugging Face checkpoint directory")
    p.add_argument("--dtype", default=_env("dtype", "auto"), choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=_env("device", "auto"))
    p.add_argument("--block-size", type=int, default=_env("block_size", 16))
    p.add_argument("--num-gpu-blocks", type=int, default=_env("num_gpu_blocks", 0),
                   help="KV pages in the pool (0: size from --kv-cache-memory-gb)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=_env("kv_cache_memory_gb", 1.0))
    p.add_argument("--gpu-memory-utilization", type=float, default=_env("gpu_memory_utilization", 0.0),
                   help="CUDA: share of the GPU's memory for this worker (weights, a step, its KV pool: the rest), "
                        "as vLLM's flag; workers sharing a GPU split it (up: across its workers). 0: size the pool "
                        "with --kv-cache-memory-gb")
    p.add_argument("--max-num-seqs", type=int, default=_env("max_num_seqs", 64))
    p.add_argument("--max-num-batched-tokens", type=int, default=_env("max_num_batched_tokens", 2048))
    _server_flags(p, host="127.0.0.1", port=0)
    p.add_argument("--worker-id", default=_env("worker_id", ""))
    p.add_argument("--num-threads", type=int, default=_env("num_threads", 0),
                   help="torch CPU threads of the engine (0: torch's default, one per core)")
    p.add_argument("--scheduling-policy", default=_env("scheduling_policy", "fcfs"), choices=["fcfs", "priority"],
                   help="order of waiting requests: arrival, or the request's priority (lower first) with aging")
    p.add_argument("--batching", default=_env("batching", "continuous"), choices=["continuous", "static"],
                   help="static: the baseline that runs fixed batches to the end (for comparisons)")
    p.add_argument("--static-batch-size", type=int, default=_env("static_batch_size", 8))
    p.add_argument("--enforce-eager", action="store_true",
                   default=_env("enforce_eager", "").lower() in ("1", "true", "yes"),
                   help="run the model op by op instead of compiling the step into one graph at start-up")


def advertised(args, port: int) -> str:
    """The address other processes reach this one at."""
    host = args.advertise_host or args.host
    return f"{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"


def _server_flags(p: argparse.ArgumentParser, host: str, port: int) -> None:
    """What every gRPC process takes: where to listen, reflection, metrics, Redis."""
    p.add_argument("--host", default=_env("host", host))
    p.add_argument("--port", type=int, default=_env("port", port), help="gRPC port (0 picks a free one)")
    p.add_argument("--advertise-host", default=_env("advertise_host", ""),
                   help="host name others use to reach this process (default: --host); e.g. the compose service "
                        "name when listening on 0.0.0.0")
    p.add_argument("--drain-timeout-s", type=float, default=_env("drain_timeout_s", 30.0),
                   help="on SIGTERM: stop taking work, let in-flight requests finish for up to this long, then stop")
    p.add_argument("--no-reflection", action="store_true", default=_env("no_reflection", "") == "1")
    p.add_argument("--metrics-port", type=int, default=_env("metrics_port", -1),
                   help="serve Prometheus metrics on this port (-1: off; 0: a free port, listed by GetServerInfo)")
    from splitserve.security import add_security_flags  # --tls-cert/-key/-ca, --auth-token, --max-message-mb
    add_security_flags(p, _env)
    _redis_flags(p)


def _redis_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=_env("redis_url", ""),
                   help="Redis holding the queue, request state and worker registry (workers: optional)")
    p.add_argument("--redis-password", default=_env("redis_password", ""))


def _redis_state(args, **kwargs):
    from gateway.redis_state import RedisState, make_client
    return RedisState(make_client(args.redis_url, password=args.redis_password or None), **kwargs)


def _engine_config(args):
    import torch

    from engine.config import EngineConfig
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                        num_gpu_blocks=args.num_gpu_blocks or None, kv_cache_memory_gb=args.kv_cache_memory_gb,
                        gpu_memory_utilization=args.gpu_memory_utilization or None,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        scheduling_policy=args.scheduling_policy, batching=args.batching,
                        static_batch_size=args.static_batch_size, enforce_eager=args.enforce_eager)


def _stop_event() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _metrics(args):
    from splitserve.metrics import serve
    host = "0.0.0.0" if args.host in ("0.0.0.0", "") else args.host
    return serve(args.metrics_port, host)


def _serve(servicer, register, args, role: str, transports: list[str], metrics_address: str = "") -> int:
    from splitserve.grpc_server import build_server
    from splitserve.registration import Heartbeat
    from splitserve.security import Security
    server, health, port = build_server(register, f"{args.host}:{args.port}",
                                        reflection_enabled=not args.no_reflection,
                                        security=Security.from_args(args))
    servicer.address = advertised(args, port)
    heartbeat = None
    if args.redis_url:
        heartbeat = Heartbeat(_redis_state(args), servicer.worker_id, role, servicer.address, transports,
                              stats=_stats_for_heartbeat(servicer, metrics_address)).start()
    # The first line on stdout says where to connect (scripts and tests read it).
    print(f"{role} worker {servicer.worker_id} serving on {servicer.address}", flush=True)
    stop = _stop_event()
    code = 0
    while not stop.wait(0.5):
        if not servicer.loop.alive:  # a dead engine must not keep answering SERVING
            log.error("engine loop died: %r; exiting so a supervisor restarts the worker", servicer.loop.error)
            code = 1
            break
    servicer.draining = True  # refuse new work first: NOT_SERVING below promises it
    health.enter_graceful_shutdown()
    if heartbeat is not None:
        heartbeat.stop()  # out of the registry: gateways route nothing new here
    if code == 0:
        _drain(servicer, args.drain_timeout_s)
    server.stop(grace=1).wait()
    servicer.close()
    return code


def _stats_for_heartbeat(servicer, metrics_address: str):
    """Engine stats for the heartbeat without waiting out a long engine step: a multi-second
    prefill must not make a healthy worker miss its beat and drop out of the registry."""
    last: dict = {}

    def stats() -> dict:
        try:
            last.update(servicer.loop.call(servicer.engine.stats, timeout=0.5))
        except concurrent.futures.TimeoutError:
            pass  # mid-step: beat with the numbers from before it
        return {**last, "metrics_address": metrics_address}
    return stats


def _drain(servicer, timeout_s: float) -> None:
    """SIGTERM: with new work refused, let what is here finish (bounded), then stop."""
    give_up = time.monotonic() + timeout_s
    log.info("draining: finishing in-flight work for up to %.0f s", timeout_s)
    while time.monotonic() < give_up and servicer.loop.alive:
        if servicer.idle():
            log.info("drained")
            return
        time.sleep(0.2)
    log.warning("drain timeout: stopping with work still in flight")


def cmd_decode(args) -> int:
    from decode_worker.servicer import DecodeWorkerServicer
    from engine.llm_engine import LLMEngine
    from kvtransfer import build_decode
    from splitserve.v1 import worker_pb2_grpc
    from splitserve.metrics import EngineMetrics
    worker_id = args.worker_id or f"{args.role}-{uuid.uuid4().hex[:8]}"
    config = _engine_config(args)
    registry, metrics_address = _metrics(args)
    metrics = EngineMetrics(registry, args.role)
    if args.role == "both":
        servicer = DecodeWorkerServicer(LLMEngine(config), None, worker_id, metrics)
    else:
        connector = build_decode(config, args.kv_transport, lease_ttl_s=args.lease_ttl_s, host=args.host,
                                 advertise_host=args.advertise_host or None)
        servicer = DecodeWorkerServicer(connector.engine, connector, worker_id, metrics)

    def register(server):
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        return ["splitserve.v1.DecodeWorker"]
    return _serve(servicer, register, args, args.role,
                  servicer.connector.transports if servicer.connector else [], metrics_address)


def cmd_prefill(args) -> int:
    from kvtransfer import TRANSPORTS, build_prefill
    from prefill_worker.servicer import PrefillWorkerServicer
    from splitserve.v1 import worker_pb2_grpc
    transports = TRANSPORTS if args.kv_transport == "auto" else [t.strip() for t in args.kv_transport.split(",")]
    from splitserve.metrics import EngineMetrics, TransferMetrics
    connector = build_prefill(_engine_config(args), transports, verify_checksum=args.verify_checksum)
    registry, metrics_address = _metrics(args)
    servicer = PrefillWorkerServicer(connector, args.worker_id or f"prefill-{uuid.uuid4().hex[:8]}",
                                     EngineMetrics(registry, "prefill"), TransferMetrics(registry))

    def register(server):
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
        return ["splitserve.v1.PrefillWorker"]
    return _serve(servicer, register, args, "prefill", list(transports), metrics_address)


def cmd_gateway(args) -> int:
    from transformers import GenerationConfig

    from engine.model_loader import load_config, load_tokenizer, resolve_model
    from gateway.dispatch import Dispatcher
    from gateway.servicer import GenerationServicer
    from gateway.workers import WorkerDirectory
    from splitserve.grpc_server import build_server
    from splitserve.v1 import generation_pb2, generation_pb2_grpc
    if not args.redis_url:
        raise SystemExit("the gateway needs --redis-url (or SPLITSERVE_REDIS_URL)")
    model_dir = resolve_model(args.model)
    config = load_config(model_dir)
    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    model_info = generation_pb2.ModelInfo(
        model=args.model, max_model_len=args.max_model_len or getattr(config, "max_position_embeddings", 2048),
        vocab_size=config.vocab_size, eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        block_size=args.block_size, dtype=args.dtype)
    from splitserve.metrics import GatewayMetrics
    state = _redis_state(args, queue_limit=args.queue_limit)
    registry, metrics_address = _metrics(args)
    from splitserve.security import Security
    security = Security.from_args(args)  # the public port, and the calls to the workers
    metrics = GatewayMetrics(registry)
    dispatcher = Dispatcher(state, WorkerDirectory(state, block_size=args.block_size,
                                                   channel_factory=security.channel),
                            args.gateway_id or f"gw-{uuid.uuid4().hex[:8]}", max_attempts=args.max_attempts,
                            on_retry=lambda reason: metrics.retries.inc()).start()
    servicer = GenerationServicer(state, dispatcher, load_tokenizer(model_dir), model_info,
                                  metrics=metrics, metrics_address=metrics_address)

    def register(server):
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        return ["splitserve.v1.Generation"]
    server, health, port = build_server(register, f"{args.host}:{args.port}",
                                        reflection_enabled=not args.no_reflection, security=security)
    from gateway.health_monitor import GatewayHealth
    monitor = GatewayHealth(health, ["splitserve.v1.Generation"], state, dispatcher.directory).start()
    servicer.health = monitor
    print(f"gateway {dispatcher.gateway_id} serving on {args.host}:{port}", flush=True)
    _stop_event().wait()
    # Drain: NOT_SERVING and no new requests; in-flight ones get the grace period to finish.
    monitor.drain()
    servicer.draining = True
    dispatcher.drain(args.drain_timeout_s)
    monitor.stop()
    server.stop(grace=2).wait()
    dispatcher.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description="LLM serving with disaggregated prefill and decode")
    parser.add_argument("--log-level", default=_env("log_level", "INFO"))
    parser.add_argument("--log-format", default=_env("log_format", "text"), choices=["text", "json"],
                        help="json: one object per line with the request id (joinable across processes)")
    sub = parser.add_subparsers(dest="command", required=True)

    decode = sub.add_parser("decode", help="run a decode worker (or a colocated prefill+decode worker)")
    _engine_flags(decode)
    decode.add_argument("--role", choices=["decode", "both"], default=_env("role", "decode"))
    decode.add_argument("--kv-transport", default=_env("kv_transport", "auto"),
                        help="transports offered to prefill workers, fastest first: auto or a comma list "
                             "of shm, tcp, nccl, cuda_ipc")
    decode.add_argument("--lease-ttl-s", type=float, default=_env("lease_ttl_s", 30.0),
                        help="seconds a reservation waits for its KV before its pages are freed")
    decode.set_defaults(func=cmd_decode)

    prefill = sub.add_parser("prefill", help="run a prefill worker")
    _engine_flags(prefill)
    prefill.add_argument("--kv-transport", default=_env("kv_transport", "auto"),
                         help="transports this worker may use to write KV: auto (all) or a comma list")
    prefill.add_argument("--verify-checksum", action="store_true", default=_env("verify_checksum", "") == "1",
                         help="send a CRC32 of each request's pages for the decode side to verify")
    prefill.set_defaults(func=cmd_prefill)

    gateway = sub.add_parser("gateway", help="run the public gRPC gateway")
    gateway.add_argument("--model", default=_env("model", "smollm2-135m-instruct"),
                         help="the model the workers serve (its tokenizer and limits)")
    _server_flags(gateway, host="0.0.0.0", port=50051)
    gateway.add_argument("--queue-limit", type=int, default=_env("queue_limit", 256),
                         help="unfinished requests (queued or running, all gateways) before RESOURCE_EXHAUSTED")
    gateway.add_argument("--max-model-len", type=int, default=_env("max_model_len", 0))
    gateway.add_argument("--block-size", type=int, default=_env("block_size", 16))
    gateway.add_argument("--dtype", default=_env("dtype", "auto"))
    gateway.add_argument("--gateway-id", default=_env("gateway_id", ""))
    gateway.add_argument("--max-attempts", type=int, default=_env("max_attempts", 3),
                         help="tries per request when a worker dies under it; then UNAVAILABLE")
    gateway.set_defaults(func=cmd_gateway)

    from splitserve.launcher import add_up_parser
    from splitserve.client import add_generate_parser
    add_up_parser(sub, _engine_flags)
    add_generate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from splitserve.logs import configure
    args = build_parser().parse_args(argv)
    configure(args.log_level, args.log_format, args.command)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
