"""The ``splitserve`` command: one subcommand per process kind.

Every flag can also come from the environment (``SPLITSERVE_<FLAG>``, e.g.
``SPLITSERVE_MODEL``), so compose files configure services without long command lines.
"""
from __future__ import annotations

import argparse
import logging
import os

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
    p.add_argument("--num-gpu-blocks", type=int, default=_env("num_gpu_blocks", None),
                   help="KV pages in the pool (0: size from --kv-cache-memory-gb)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=_env("kv_cache_memory_gb", 1.0))
    p.add_argument("--max-num-seqs", type=int, default=_env("max_num_seqs", 64))
    p.add_argument("--max-num-batched-tokens", type=int, default=_env("max_num_batched_tokens", 2048))
    _server_flags(p, host="127.0.0.1", port=0)
    p.add_argument("--worker-id", default=_env("worker_id", ""))
    p.add_argument("--num-threads", type=int, default=_env("num_threads", 0),
                   help="torch CPU threads of the engine (0: torch's default, one per core)")
    p.add_argument("--scheduling-policy", default=_env("scheduling_policy", "priority"), choices=["fcfs", "priority"],
                   help="order of waiting requests: arrival, or the request's priority (lower first) with aging")
    p.add_argument("--batching", default=_env("batching", "continuous"), choices=["continuous", "static"],
                   help="static: the baseline that runs fixed batches to the end (for comparisons)")
    p.add_argument("--static-batch-size", type=int, default=_env("static_batch_size", 8))
    p.add_argument("--priority-aging-per-s", type=float, default=_env("priority_aging_per_s", 1.0))


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


def cmd_decode(args) -> int:
    from decode_worker.server import serve
    return serve(args)


def cmd_prefill(args) -> int:
    from prefill_worker.server import serve
    return serve(args)


def cmd_gateway(args) -> int:
    from gateway.server import serve
    return serve(args)


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
    gateway.add_argument("--priority-aging-per-s", type=float, default=_env("priority_aging_per_s", 1.0))
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
