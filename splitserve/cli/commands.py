"""The ``splitserve`` command: one subcommand per process kind. This module only parses.

Every flag also reads ``SPLITSERVE_<FLAG>`` from the environment (e.g. ``SPLITSERVE_MODEL``),
so compose files configure services without long command lines; ``--help`` lists each flag's
default and variable. The flags are declared once in ``splitserve/cli/flags.py`` (the engine's are
derived from ``EngineConfig``); what each process does with them lives with the process:
``splitserve/worker/decode/server.py``, ``splitserve/worker/prefill/server.py``, ``splitserve/gateway/server.py``,
``splitserve/cli/up.py`` (``up``), ``splitserve/cli/tune.py`` (``tune``), ``splitserve/client.py`` (``generate``).
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

import click

from splitserve.cli.flags import options, up_options

# The commands that run an engine, and so start again under tcmalloc when they are the process's own.
ENGINE_COMMANDS = frozenset({"decode", "prefill"})
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110, "terminal_width": 110}


def _config_errors(params: dict, configs: tuple[type, ...]) -> None:
    """A value a config dataclass refuses (say --block-size 3, --max-stop-sequences 0) is a usage
    error that says what to change."""
    import dataclasses

    for config in configs:
        names = {f.name for f in dataclasses.fields(config)}
        try:
            config(**{k: v for k, v in params.items() if k in names})
        except ValueError as e:
            raise click.UsageError(str(e)) from None


def _engine_config():
    from splitserve.engine.config import EngineConfig
    return EngineConfig


def _request_limits():
    from splitserve.common.limits import RequestLimits
    return RequestLimits


def _output_limits():
    from splitserve.common.limits import OutputLimits
    return OutputLimits


def _role_control():
    from splitserve.cli.role_controller import RoleControl
    return RoleControl


def _disaggregation_policy():
    from splitserve.gateway.prefill_placement import DisaggregationPolicy
    return DisaggregationPolicy


def _command(name: str, help: str, params: list[click.Option], run: Callable[[argparse.Namespace], int],
             configs: tuple[Callable[[], type], ...] = ()) -> click.Command:
    def callback(**values):
        ctx = click.get_current_context()
        if name in ENGINE_COMMANDS and (ctx.find_root().obj or {}).get("own_process"):
            from splitserve.cli.allocator import restart_with_tcmalloc
            restart_with_tcmalloc()  # before torch loads (splitserve/cli/allocator.py says why)
        _config_errors(values, tuple(config() for config in configs))
        args = argparse.Namespace(command=name, **ctx.find_root().params, **values)
        from splitserve.common.logs import configure
        configure(args.log_level, args.log_format, name)
        ctx.exit(run(args))
    from splitserve.cli import config_file
    return click.Command(name, params=[config_file.option(), *params], callback=callback, help=help,
                         context_settings=CONTEXT)


# What each command runs. Imported when the command runs, not before: `splitserve --help` and the
# gateway never load torch, and each process loads only its own role.
def _serve_decode(args) -> int:
    from splitserve.worker.decode.server import serve
    return _refusing_unsupported_models(serve, args)


def _serve_prefill(args) -> int:
    from splitserve.worker.prefill.server import serve
    return _refusing_unsupported_models(serve, args)


def _refusing_unsupported_models(serve, args) -> int:
    """A model the engine cannot serve exactly is the user's to change: one line that says why,
    exit 1, no traceback."""
    from splitserve.engine.model_registry import UnsupportedModel
    try:
        return serve(args)
    except UnsupportedModel as e:
        raise click.ClickException(str(e)) from None


def _serve_gateway(args) -> int:
    from splitserve.gateway.server import serve
    return serve(args)


def _up(args) -> int:
    from splitserve.cli.up import cmd_up
    return cmd_up(args)


def _tune(args) -> int:
    from splitserve.cli.tune import cmd_tune
    return cmd_tune(args)


def _generate(args) -> int:
    from splitserve.client import cmd_generate
    return cmd_generate(args)


def _up_params() -> list[click.Option]:
    return up_options() + [
        click.Option(["--prefill"], type=click.IntRange(min=0), default=None,
                     help="prefill workers (0 with --decode 0: one colocated 'both' worker). Neither given: on a "
                          "CPU of fewer than 4 cores one colocated worker, else 1 and 1 (up says which and why)"),
        click.Option(["--decode"], type=click.IntRange(min=0), default=None,
                     help="decode workers (1 when only --prefill is given)"),
        click.Option(["--prefill-threads"], type=click.IntRange(min=0), default=0, show_default=True,
                     help="torch threads of each prefill worker (0: --num-threads, else the cores split evenly)"),
        click.Option(["--decode-threads"], type=click.IntRange(min=0), default=0, show_default=True,
                     help="torch threads of each decode (or colocated) worker (0: as --prefill-threads)"),
        click.Option(["--prefill-tensor-parallel-size"], type=click.IntRange(min=0), default=0, show_default=True,
                     help="ranks of each prefill worker (0: --tensor-parallel-size); may differ from the decode "
                          "workers': KV is then re-sharded by head (over shm, cuda_ipc or tcp)"),
        click.Option(["--decode-tensor-parallel-size"], type=click.IntRange(min=0), default=0, show_default=True,
                     help="ranks of each decode (or colocated) worker (0: --tensor-parallel-size)"),
        click.Option(["--prefill-device"], default="", metavar="DEVICE",
                     help="the device of each prefill worker (cuda:0, ...; empty: --device): prefill and decode "
                          "workers on GPUs of their own, the KV moving between them (cuda_ipc, nccl)"),
        click.Option(["--decode-device"], default="", metavar="DEVICE",
                     help="the device of each decode (or colocated) worker (empty: --device)"),
        click.Option(["--demo"], metavar="QUESTION", default="",
                     help="ask one question through the stack, print the answer, then shut down"),
        click.Option(["--child-log-level"], default="WARNING", show_default=True,
                     help="log level of the processes it starts"),
        *_role_control_params(),
    ]


def _role_control_params() -> list[click.Option]:
    """``up --role-controller`` and its settings (splitserve/cli/role_controller.py)."""
    from splitserve.cli.role_controller import RoleControl
    d = RoleControl()
    env = dict(show_envvar=True, show_default=True)
    return [
        click.Option(["--role-controller/--no-role-controller"], default=d.role_controller,
                     envvar="SPLITSERVE_ROLE_CONTROLLER", **env,
                     help="move workers between prefill and decode as the load changes: a decode worker becomes "
                          "a prefill worker when first tokens are late and later tokens have room, and the "
                          "reverse (drained, restarted in the new role; nothing lost)"),
        click.Option(["--min-prefill-workers"], type=int, default=d.min_prefill_workers,
                     envvar="SPLITSERVE_MIN_PREFILL_WORKERS", **env,
                     help="the controller keeps at least this many (0 needs --disaggregation never or auto)"),
        click.Option(["--min-decode-workers"], type=int, default=d.min_decode_workers,
                     envvar="SPLITSERVE_MIN_DECODE_WORKERS", **env, help="the controller keeps at least this many"),
        click.Option(["--role-ttft-target-ms"], type=float, default=d.role_ttft_target_ms,
                     envvar="SPLITSERVE_ROLE_TTFT_TARGET_MS", **env,
                     help="the controller's first-token target (p90 over each check)"),
        click.Option(["--role-tpot-target-ms"], type=float, default=d.role_tpot_target_ms,
                     envvar="SPLITSERVE_ROLE_TPOT_TARGET_MS", **env,
                     help="the controller's per-token target (p90 over each check)"),
        click.Option(["--role-check-interval-s"], type=float, default=d.role_check_interval_s,
                     envvar="SPLITSERVE_ROLE_CHECK_INTERVAL_S", **env,
                     help="how often the controller reads the latencies (a move needs 3 checks in a row)"),
        click.Option(["--role-change-interval-s"], type=float, default=d.role_change_interval_s,
                     envvar="SPLITSERVE_ROLE_CHANGE_INTERVAL_S", **env, help="the least time between two moves"),
    ]


def _generate_params() -> list[click.Parameter]:
    env = dict(show_envvar=True)
    return [
        click.Argument(["prompt"]),
        click.Option(["--address"], default="localhost:50051", show_default=True, envvar="SPLITSERVE_ADDRESS", **env),
        click.Option(["--chat"], is_flag=True, help="send the prompt as a user message (chat template)"),
        click.Option(["--max-tokens"], type=int, default=64, show_default=True),
        click.Option(["--temperature"], type=float, default=0.0, show_default=True),
        click.Option(["--top-p"], type=float, default=None),
        click.Option(["--seed"], type=int, default=None),
        click.Option(["--timeout"], type=float, default=120.0, show_default=True),
        click.Option(["--tls"], is_flag=True, help="TLS, verifying the gateway against the system's roots"),
        click.Option(["--tls-ca"], default="", envvar="SPLITSERVE_TLS_CA", **env,
                     help="PEM CA bundle to verify the gateway with (implies TLS)"),
        click.Option(["--tls-cert"], default="", envvar="SPLITSERVE_TLS_CERT", **env,
                     help="PEM client certificate (mutual TLS)"),
        click.Option(["--tls-key"], default="", envvar="SPLITSERVE_TLS_KEY", **env, help="PEM private key of --tls-cert"),
        click.Option(["--auth-token"], default="", envvar="SPLITSERVE_AUTH_TOKEN", **env,
                     help="bearer token of a gateway run with --auth-token (prefer the environment variable)"),
    ]


def _tune_params() -> list[click.Option]:
    o = click.Option
    return [
        o(["--slo-ttft-p99-ms"], type=float, required=True, help="SLO: TTFT p99 at most this (ms)"),
        o(["--slo-tpot-p50-ms"], type=float, required=True, help="SLO: TPOT p50 at most this (ms)"),
        o(["--workload"], type=click.Path(exists=True, dir_okay=False), default=None,
          help="JSONL, one request a line: prompt (text) or prompt_token_ids, and max_tokens (default: --mixed)"),
        o(["--mixed"], is_flag=True, help="the mixed workload: prompts of 32-256 tokens, outputs of 16-128 (the default)"),
        o(["--num-requests"], type=click.IntRange(min=1), default=32, show_default=True,
          help="requests of the mixed workload in each probe"),
        o(["--model"], default="smollm2-135m-instruct", show_default=True, envvar="SPLITSERVE_MODEL"),
        o(["--dtype"], default="auto", show_default=True),
        o(["--max-num-seqs"], default="16,64", show_default=True, help="values to sweep (comma list)"),
        o(["--max-num-batched-tokens"], default="512,2048", show_default=True, help="values to sweep"),
        o(["--block-size"], default="16", show_default=True, help="values to sweep"),
        o(["--splits"], default="colocated,1:1", show_default=True,
          help="prefill:decode splits to sweep: colocated, P:D (workers), P:D@p:d (and threads per worker)"),
        o(["--up-args"], default="", help="further flags of every `splitserve up` it starts, e.g. "
          "'--kv-cache-memory-gb 2'"),
        o(["--address"], default="", help="measure the goodput of this running gateway instead (no sweep)"),
        o(["--start-rate"], type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
          help="first request rate (req/s) of each search"),
        o(["--max-rate"], type=click.FloatRange(min=0, min_open=True), default=64.0, show_default=True),
        o(["--search-steps"], type=click.IntRange(min=0), default=2, show_default=True,
          help="bisections after the rate that broke the SLO"),
        o(["--seed"], type=int, default=0, show_default=True),
        o(["--out"], default="splitserve-tune", show_default=True, help="folder of tune.json and tune.png"),
        o(["--config-out"], default="", help="the best point's config file (default: OUT/tuned.yaml)"),
    ]


def build() -> click.Group:
    group = click.Group("splitserve", context_settings=CONTEXT,
                        help="LLM serving with disaggregated prefill and decode.", params=[
                            click.Option(["--log-level"], default="INFO", envvar="SPLITSERVE_LOG_LEVEL",
                                         show_envvar=True, show_default=True),
                            click.Option(["--log-format"], type=click.Choice(["text", "json"]), default="text",
                                         envvar="SPLITSERVE_LOG_FORMAT", show_envvar=True, show_default=True,
                                         help="json: one object per line with the request id (joinable across "
                                              "processes)")])
    group.add_command(_command("decode", "Run a decode worker (or, with --role both, a colocated prefill+decode "
                                         "worker).", options("decode"), _serve_decode,
                               configs=(_engine_config,)))
    group.add_command(_command("prefill", "Run a prefill worker.", options("prefill"), _serve_prefill,
                               configs=(_engine_config,)))
    group.add_command(_command("gateway", "Run the public gRPC gateway.", options("gateway"), _serve_gateway,
                               configs=(_request_limits, _output_limits, _disaggregation_policy)))
    group.add_command(_command("up", "Start Redis, a gateway, prefill and decode workers on this machine, and "
                                     "supervise them.", _up_params(), _up,
                               configs=(_engine_config, _request_limits, _output_limits, _disaggregation_policy,
                                        _role_control)))
    group.add_command(_command("tune", "Find the configuration with the highest goodput within an SLO: start a "
                                       "stack per point of a grid, search its highest request rate, write the "
                                       "best as a --config file.", _tune_params(), _tune))
    group.add_command(_command("generate", "Stream a generation from a running gateway to the terminal.",
                               _generate_params(), _generate))
    return group


def parse(argv: list[str]) -> argparse.Namespace:
    """The arguments ``splitserve <command> <flags...>`` runs with (environment included), without
    running it. Raises ``click.UsageError`` (or ``BadParameter``) on a bad flag or value."""
    group = build()
    command = group.commands[argv[0]]
    with group.make_context("splitserve", [argv[0]]) as root:
        with command.make_context(argv[0], list(argv[1:]), parent=root) as ctx:
            return argparse.Namespace(command=argv[0], **root.params, **ctx.params)


def main(argv: list[str] | None = None) -> int:
    """``argv`` None: the command line of this process, which a worker command may then restart
    (``splitserve.cli.allocator``); a list: a command run inside a process that is not its own."""
    try:
        build().main(args=argv, prog_name="splitserve", standalone_mode=True, obj={"own_process": argv is None})
    except SystemExit as e:
        if isinstance(e.code, str):  # a process refusing its configuration says why
            print(f"splitserve: {e.code}", file=sys.stderr)
            return 1
        return 0 if e.code is None else e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
