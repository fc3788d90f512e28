"""The ``splitserve`` command: one subcommand per process kind.

Every flag can also come from the environment (``SPLITSERVE_<FLAG>``, e.g.
``SPLITSERVE_MODEL``), so compose files configure services without long command lines.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
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
    p.add_argument("--max-num-seqs", type=int, default=_env("max_num_seqs", 64))
    p.add_argument("--max-num-batched-tokens", type=int, default=_env("max_num_batched_tokens", 2048))
    p.add_argument("--host", default=_env("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=_env("port", 0), help="gRPC port (0 picks a free one)")
    p.add_argument("--worker-id", default=_env("worker_id", ""))
    p.add_argument("--no-reflection", action="store_true", default=_env("no_reflection", "") == "1")


def _engine_config(args):
    from engine.config import EngineConfig
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                        num_gpu_blocks=args.num_gpu_blocks or None, kv_cache_memory_gb=args.kv_cache_memory_gb,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)


def _serve(servicer, register, args, role: str) -> int:
    from splitserve.grpc_server import build_server
    server, health, port = build_server(register, f"{args.host}:{args.port}",
                                        reflection_enabled=not args.no_reflection)
    servicer.address = f"{args.host}:{port}"
    # The first line on stdout says where to connect (scripts and tests read it).
    print(f"{role} worker {servicer.worker_id} serving on {servicer.address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        if not servicer.loop.alive:  # a dead engine must not keep answering SERVING
            log.error("engine loop died: %r; exiting so a supervisor restarts the worker", servicer.loop.error)
            health.enter_graceful_shutdown()
            server.stop(grace=1).wait()
            return 1
    health.enter_graceful_shutdown()
    server.stop(grace=5).wait()
    servicer.close()
    return 0


def cmd_decode(args) -> int:
    from decode_worker.servicer import DecodeWorkerServicer
    from engine.llm_engine import LLMEngine
    from kvtransfer import build_decode
    from splitserve.v1 import worker_pb2_grpc
    worker_id = args.worker_id or f"{args.role}-{uuid.uuid4().hex[:8]}"
    config = _engine_config(args)
    if args.role == "both":
        servicer = DecodeWorkerServicer(LLMEngine(config), None, worker_id)
    else:
        connector = build_decode(config, args.kv_transport, lease_ttl_s=args.lease_ttl_s, host=args.host)
        servicer = DecodeWorkerServicer(connector.engine, connector, worker_id)

    def register(server):
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        return ["splitserve.v1.DecodeWorker"]
    return _serve(servicer, register, args, args.role)


def cmd_prefill(args) -> int:
    from kvtransfer import TRANSPORTS, build_prefill
    from prefill_worker.servicer import PrefillWorkerServicer
    from splitserve.v1 import worker_pb2_grpc
    transports = TRANSPORTS if args.kv_transport == "auto" else [t.strip() for t in args.kv_transport.split(",")]
    connector = build_prefill(_engine_config(args), transports, verify_checksum=args.verify_checksum)
    servicer = PrefillWorkerServicer(connector, args.worker_id or f"prefill-{uuid.uuid4().hex[:8]}")

    def register(server):
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
        return ["splitserve.v1.PrefillWorker"]
    return _serve(servicer, register, args, "prefill")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description="LLM serving with disaggregated prefill and decode")
    parser.add_argument("--log-level", default=_env("log_level", "INFO"))
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
