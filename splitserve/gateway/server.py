"""Wiring of a gateway process (``splitserve gateway``): model info, Redis, dispatcher, servicer, server.

``serve(args)`` runs until SIGTERM/SIGINT, then drains: NOT_SERVING and no new requests at
once, in-flight ones get ``--drain-timeout-s`` to finish, the rest end with UNAVAILABLE.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import time
import uuid
from pathlib import Path

from splitserve.common.aio import wait_for

log = logging.getLogger(__name__)

SERVICE = "splitserve.v1.Generation"  # also its readiness name (splitserve.common.grpc_server)


def serve(args) -> int:
    if not args.redis_url:
        raise SystemExit("the gateway needs --redis-url (or SPLITSERVE_REDIS_URL)")
    _without_torch()
    code = asyncio.run(_serve(args))
    # After this only the interpreter's exit is left (joining threads): a gateway whose log ends
    # at "stopped in" and not here was held in asyncio.run's teardown.
    log.info("event loop closed; exiting with %d", code)
    return code


def _without_torch() -> None:
    """A gateway never loads torch (hundreds of MB and seconds of start-up for nothing it does):
    make it unimportable in this process, so that transformers takes it as absent (its tokenizers,
    configs and chat templates need none) and a code path that would import it fails loudly in
    the tests instead of costing every gateway. Structured-output specs are checked in a child
    process (``grammar_check``), as the grammar library loads torch."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # the import system's own "not installed here"
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # its "PyTorch was not found" line


def model_info(args):
    """The public ModelInfo, the tokenizer and the sampling defaults (``--generation-config``) of
    the served model: its files only, no weights and no torch (``splitserve.engine.model_files``)."""
    from splitserve.common.metrics import public_model_name
    from splitserve.engine.model_files import eos_token_ids, load_tokenizer, read_config, resolve_model
    from splitserve.v1 import generation_pb2
    model_dir = resolve_model(args.model)
    config = read_config(model_dir)
    info = generation_pb2.ModelInfo(
        model=public_model_name(args.model),
        max_model_len=args.max_model_len or config.get("max_position_embeddings", 2048),
        vocab_size=config["vocab_size"], eos_token_ids=eos_token_ids(model_dir),
        block_size=args.block_size, dtype=args.dtype)
    return info, load_tokenizer(model_dir), generation_defaults(args.generation_config, model_dir)


def generation_defaults(source: str, model_dir: Path) -> dict[str, float | int]:
    """``--generation-config``: ``auto``, the model's ``generation_config.json``; ``vllm``, none
    (the server's own defaults, vLLM's name for it); else a directory holding a
    ``generation_config.json``. Refused at start when the file cannot be read or holds a value no
    request could take."""
    from splitserve.engine.model_files import sampling_defaults
    from splitserve.wire import check_sampling_defaults
    if source == "vllm":
        return {}
    directory = model_dir if source == "auto" else Path(source)
    path = directory / "generation_config.json"
    if source != "auto" and not path.is_file():
        raise SystemExit(f"splitserve: --generation-config {source}: no generation_config.json there "
                         "(give auto, vllm or a directory holding one)")
    try:
        defaults = sampling_defaults(directory)
        check_sampling_defaults(defaults)
    except ValueError as e:  # json's errors are ValueErrors too
        raise SystemExit(f"splitserve: {path}: {e} (--generation-config vllm ignores the file)") from None
    if defaults:
        log.info("sampling defaults from %s: %s (a request's own values win; --generation-config vllm turns "
                 "these off)", path, ", ".join(f"{k} {v}" for k, v in defaults.items()))
    return defaults


async def _serve(args) -> int:
    from splitserve.gateway.backpressure import Backpressure
    from splitserve.gateway.chat_output.plan import ChatOutputs
    from splitserve.gateway.dispatch import Dispatcher
    from splitserve.gateway.health_monitor import GatewayHealth
    from splitserve.state.store import RedisState, make_async_client
    from splitserve.gateway.servicer import GenerationServicer
    from splitserve.gateway.workers import WorkerDirectory
    from splitserve.common.grpc_server import start_server, stop_event
    from splitserve.common.limits import OutputLimits, RequestLimits
    from splitserve.common.metrics import GatewayMetrics, serve_metrics
    from splitserve.common.tracing import setup as setup_tracing
    from splitserve.common.authz import gateway_credentials
    from splitserve.common.locality import is_loopback
    from splitserve.v1 import generation_pb2_grpc
    from splitserve.gateway.memory import return_big_buffers
    from splitserve.gateway.prefill_placement import DisaggregationPolicy
    from splitserve.common.gc_heap import freeze_startup_heap
    return_big_buffers()
    # Checked before anything starts: the client and admin tokens of the public port, the
    # internal token of the calls to the workers.
    authorizer, security, internal = gateway_credentials(args)
    if not is_loopback(args.host) and security.cert is None and authorizer.open:
        log.warning("the gateway serves %s with neither TLS nor a client token: anyone who reaches it may generate, "
                    "and read or abort every request. Give --tls-cert and --auth-token, or listen on 127.0.0.1 "
                    "(the default) or a private network only", args.host)
    http_socket = None
    if args.http_port >= 0:
        from splitserve.gateway.openai_api.server import bind
        http_socket = bind(args.host, args.http_port)
    info, tokenizer, sampling_defaults = model_info(args)
    state = RedisState(make_async_client(args.redis_url, password=args.redis_password or None),
                       queue_limit=args.queue_limit, priority_aging_per_s=args.priority_aging_per_s,
                       registry_key=internal.registry_key)
    registry, metrics_address = serve_metrics(args.metrics_port, args.host, model_name=info.model)
    metrics = GatewayMetrics(registry)
    directory = WorkerDirectory(state, block_size=args.block_size, channel_factory=internal.aio_channel,
                                on_untrusted=metrics.untrusted_workers.set,
                                prefix_routing=args.prefix_routing == "directory",
                                disaggregation=DisaggregationPolicy(args.disaggregation, args.local_prefill_tokens,
                                                                    args.prefill_queue_limit),
                                on_prefill_placement=lambda p: metrics.prefill_placements.labels(p.where,
                                                                                                 p.reason).inc())
    gateway_id = args.gateway_id or f"gw-{uuid.uuid4().hex[:8]}"
    setup_tracing("gateway", gateway_id)
    dispatcher = Dispatcher(state, directory, gateway_id,
                            max_attempts=args.max_attempts, on_retry=lambda reason: metrics.retries.inc())
    await dispatcher.start()
    limits = RequestLimits.from_args(args).resolve(info.max_model_len, tokenizer)
    log.info("request limits: %s", ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(limits).items()))
    output_limits = OutputLimits.from_args(args)
    log.info("output limits: %s", ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(output_limits).items()))
    backpressure = Backpressure(output_limits, on_cut=metrics.slow_readers_cut.inc).start()
    metrics.unread_output.set_function(lambda: backpressure.buffered_bytes)
    servicer = GenerationServicer(state, dispatcher, tokenizer, info, limits, metrics=metrics,
                                  metrics_address=metrics_address, backpressure=backpressure,
                                  authorizer=authorizer, sampling_defaults=sampling_defaults,
                                  chat_outputs=ChatOutputs.from_flags(tokenizer, args.tool_call_parser,
                                                                      args.enable_auto_tool_choice,
                                                                      args.reasoning_parser))

    def register(server):
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        return [SERVICE]
    # Not ready until the health monitor has seen Redis and a usable set of workers.
    server, health, port = await start_server(register, f"{args.host}:{args.port}",
                                              reflection_enabled=not args.no_reflection, security=security,
                                              ready=False)
    monitor = await GatewayHealth(health, [SERVICE], state, directory).start()
    servicer.health = monitor
    http = await _start_http(args, servicer, authorizer, http_socket) if http_socket is not None else None
    if http is not None:
        print(f"gateway {dispatcher.gateway_id} HTTP (OpenAI API) on {args.host}:{http.port}", flush=True)
    freeze_startup_heap()  # tokenizer, clients, servers: no full collection walks them again
    print(f"gateway {dispatcher.gateway_id} serving on {args.host}:{port}", flush=True)
    await stop_event().wait()
    await _shutdown(args, monitor, servicer, dispatcher, http, server, backpressure, directory)
    return 0


# A bound on each step of the shutdown after the drain: one that overruns is logged by name and
# left behind, so SIGTERM ends the process within the drain timeout plus these, whatever hangs.
STOP_STEP_LIMIT_S = 5.0


async def _shutdown(args, monitor, servicer, dispatcher, http, server, backpressure, directory) -> None:
    """Drain (NOT_SERVING, no new requests, in-flight ones get the grace period), then stop the
    parts in order; each step's time goes to the log, so a slow exit says which part held it."""
    started = time.monotonic()
    await monitor.drain()
    servicer.draining = True
    log.info("draining: %d request(s) in flight, up to %g s", len(dispatcher.jobs), args.drain_timeout_s)
    await dispatcher.drain(args.drain_timeout_s)
    steps = [("health", monitor.stop()), ("http", http.stop() if http is not None else None),
             ("grpc server", server.stop(grace=2)), ("backpressure", backpressure.stop()),
             ("dispatcher", dispatcher.stop()), ("worker channels", directory.close()),
             ("grammar checker", servicer.grammars.close())]
    for name, step in steps:
        if step is None:
            continue
        step_started = time.monotonic()
        try:
            await wait_for(step, STOP_STEP_LIMIT_S)
        except asyncio.TimeoutError:
            log.error("shutdown: stopping the %s took over %g s; going on without it", name, STOP_STEP_LIMIT_S)
        else:
            log.debug("shutdown: %s stopped in %.2f s", name, time.monotonic() - step_started)
    log.info("stopped in %.2f s after the signal", time.monotonic() - started)


async def _start_http(args, servicer, authorizer, sock):
    """The OpenAI-compatible HTTP API on ``--http-port`` (same host, TLS / mutual TLS and tokens as gRPC)."""
    from splitserve.gateway.openai_api.app import build_app
    from splitserve.gateway.openai_api.server import HttpServer
    return await HttpServer(build_app(servicer, authorizer, model_aliases=[args.model]), sock,
                            ssl_certfile=args.tls_cert, ssl_keyfile=args.tls_key, ssl_ca=args.tls_ca,
                            max_connections=args.http_max_connections, max_body_bytes=int(args.max_message_mb * 2**20),
                            body_timeout_s=args.http_body_timeout_s,
                            header_timeout_s=args.http_header_timeout_s).start()
