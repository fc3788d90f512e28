"""Every flag of every ``splitserve`` process, declared once.

A ``Flag`` says which process kinds take it (``decode``, ``prefill``, ``gateway``), its type,
default and help, and how ``up`` hands it on. The engine's flags are not written here: they
are derived from ``splitserve.engine.config.EngineConfig``, one per field, with the field's comment as
help, so a new config field gets its flag by itself; the gateway's request size limits
(``--max-prompt-bytes``...) and bounds on unread output (``--slow-reader-timeout-s``...) are
derived the same way from ``splitserve.common.limits.RequestLimits`` and ``OutputLimits``.
Each flag also reads the environment
variable ``SPLITSERVE_<NAME>`` (click's ``envvar``); ``--help`` shows the default and the
variable, and a bad value is a usage error naming the flag, not a traceback.

``forward(args, kind)`` turns the values of an ``up`` command into the command line (and, for
secrets, the environment) of one of its children, so ``up`` forwards every flag it takes.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from dataclasses import dataclass

import click

from splitserve.engine.config import (ASYNC_SCHEDULING, ATTENTION_BACKENDS, BATCHING_MODES, DTYPES, KV_CACHE_DTYPES,
                                      PREEMPTION_MODES, SCHEDULING_POLICIES, EngineConfig)
from splitserve.common.limits import OutputLimits, RequestLimits
from splitserve.gateway.chat_output.reasoning import PARSERS as REASONING_PARSERS
from splitserve.gateway.chat_output.tool_parsers import PARSERS as TOOL_PARSERS

ENV_PREFIX = "SPLITSERVE_"
WORKERS = frozenset({"decode", "prefill"})
ALL = frozenset({"decode", "prefill", "gateway"})


@dataclass(frozen=True)
class Flag:
    name: str  # python name; the flag is --name-with-dashes, the variable SPLITSERVE_NAME
    type: object  # click type
    default: object
    help: str
    kinds: frozenset  # process kinds that take it
    up: bool = True  # `up` offers it (and forwards it to its children of those kinds)
    up_to: frozenset | None = None  # the children `up` forwards it to, when not every kind
    secret: bool = False  # handed on through the environment, never a command line
    is_bool: bool = False  # --name/--no-name

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def envvar(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def switch(self) -> bool:
        """A bool that only turns something off (--no-reflection): one flag, no --no-no- twin."""
        return self.is_bool and self.name.startswith("no_")

    def click_option(self, default=None, help: str | None = None) -> click.Option:
        default = self.default if default is None else default
        common = dict(default=default, envvar=self.envvar, show_envvar=True, show_default=not self.secret,
                      help=help or self.help)
        if self.switch:
            return click.Option([self.option, self.name], is_flag=True, **common)
        if self.is_bool:
            return click.Option([f"{self.option}/--no-{self.option[2:]}", self.name], **common)
        return click.Option([self.option, self.name], type=self.type, **common)

    def argv(self, value) -> list[str]:
        """The command line that gives this flag ``value``."""
        if self.switch:
            return [self.option] if value else []
        if self.is_bool:
            return [self.option if value else f"--no-{self.option[2:]}"]
        return [self.option, str(value)]


# ---- the engine's flags, from EngineConfig ---------------------------------------------

_CHOICES = {"scheduling_policy": SCHEDULING_POLICIES, "preemption_mode": PREEMPTION_MODES,
            "batching": BATCHING_MODES, "dtype": DTYPES, "attention_backend": ATTENTION_BACKENDS,
            "kv_cache_dtype": KV_CACHE_DTYPES, "async_scheduling": ASYNC_SCHEDULING}
# EngineConfig fields the gateway needs too (its tokenizer, limits, page size, queue order).
_GATEWAY_FIELDS = {"model", "block_size", "max_model_len", "dtype", "priority_aging_per_s"}


def _field_comments(cls) -> dict[str, str]:
    """The comment lines right above each field of a dataclass, joined."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("# "))
            continue
        match = re.match(r"(\w+)\s*:", stripped)
        if match and pending:
            comments[match.group(1)] = " ".join(pending)
        pending = []
    return comments


def _click_type(field: dataclasses.Field, hint) -> object:
    if field.name in _CHOICES:
        return click.Choice(_CHOICES[field.name])
    base = [a for a in typing.get_args(hint) if a is not type(None)][0] if typing.get_args(hint) else hint
    return {int: click.INT, float: click.FLOAT, str: click.STRING, bool: click.BOOL}[base]


def _dataclass_flags(cls, kinds: typing.Callable[[str], frozenset]) -> list[Flag]:
    """One flag per field of the dataclass ``cls``: its type, default and comment; ``kinds(name)``
    says which processes take it."""
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    flags = []
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        flags.append(Flag(field.name, _click_type(field, hint), field.default,
                          comments.get(field.name, f"{cls.__name__}.{field.name}"), kinds(field.name),
                          is_bool=hint is bool))
    return flags


def engine_flags() -> list[Flag]:
    return _dataclass_flags(EngineConfig, lambda name: WORKERS | ({"gateway"} if name in _GATEWAY_FIELDS else set()))


def limit_flags() -> list[Flag]:
    """The gateway's request size limits and bounds on unread output (``splitserve.common.limits``), one
    flag per field."""
    gateway = lambda name: frozenset({"gateway"})  # noqa: E731
    return _dataclass_flags(RequestLimits, gateway) + _dataclass_flags(OutputLimits, gateway)


# ---- the services' own flags -----------------------------------------------------------

def _flags() -> list[Flag]:
    f = Flag
    s, i, fl = click.STRING, click.INT, click.FLOAT
    gw = frozenset({"gateway"})
    return [
        # Where to listen (the gateway's public port; workers pick a free one by default).
        f("host", s, None, "address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 or a "
          "container's own address to serve others, with --tls-cert and --auth-token beyond a private network)",
          ALL, up_to=gw),
        f("port", i, None, "gRPC port (0 picks a free one; gateway 50051, workers 0)", ALL, up_to=gw),
        f("advertise_host", s, "", "host name others use to reach this process (default: --host), e.g. the "
          "compose service name when listening on 0.0.0.0", ALL, up=False),
        f("drain_timeout_s", fl, 30.0, "on SIGTERM: stop taking work, let in-flight requests finish for up to "
          "this long, then stop", ALL),
        f("no_reflection", click.BOOL, False, "turn gRPC server reflection off", ALL, is_bool=True),
        f("metrics_port", i, -1, "Prometheus /metrics port (-1: off; 0: a free one, listed by GetServerInfo; "
          "up: the gateway's, workers on the ports after it)", ALL),
        f("tls_cert", s, "", "PEM certificate chain: the gRPC port serves TLS only (also presented to other "
          "splitserve processes when --tls-ca is set); needs SANs for the advertised names/IPs", ALL),
        f("tls_key", s, "", "PEM private key of --tls-cert", ALL),
        f("tls_ca", s, "", "PEM CA bundle: with --tls-cert, clients must present a certificate it signed "
          "(mutual TLS); for calls this process makes, the root servers are verified with", ALL),
        f("auth_token", s, "", "gateway: a client token, required as 'authorization: Bearer <token>' on every "
          "call (health checks stay open; its requests belong to it); prefer the environment variable, a "
          "command line is visible to every local user. Workers refuse it: they take --internal-token", ALL,
          up_to=gw, secret=True),
        f("token_file", s, "", "file of further client tokens, one per line ('#' comments): each is its own "
          "owner of the requests it creates; read at start", gw),
        f("admin_token", s, "", "the admin token: may read and abort every request and sees worker and "
          "metrics addresses in GetServerInfo", gw, secret=True),
        f("internal_token", s, "", "the gateway's credential on the worker ports: workers require it, the "
          "gateway sends it (never a client's token; up makes one when security is on and none is given)",
          ALL, secret=True),
        f("max_message_mb", fl, 16.0, "largest gRPC message accepted or sent, in MiB", ALL),
        f("redis_url", s, "", "Redis holding the queue, request state and registries (workers: optional; "
          "up: a private redis-server when empty)", ALL),
        f("redis_password", s, "", "Redis AUTH password (prefer the environment variable)", ALL, secret=True),
        # Workers.
        f("worker_id", s, "", "id in the registry (default: <role>-<random>)", WORKERS, up=False),
        f("host_id", s, "", "which workers share a host for shm / cuda_ipc (the gateway prefers such pairs); "
          "default: the boot id and the shm directory this process sees", WORKERS, up=False),
        f("num_threads", i, 0, "torch CPU threads of the engine (0: torch's default; up splits the cores "
          "between its workers)", WORKERS),
        f("engine_niceness", click.IntRange(0, 19), 5, "CPU workers of one rank: how much lower the engine "
          "thread's CPU priority (nice value) is than the rest of the process's, and so than the gateway's and "
          "Redis's beside it (under one session, as up starts them); its torch threads inherit it. Where they "
          "share a few cores, a request's hops (admission, the Redis call, the worker's handler, a token's relay) "
          "run ahead of a step's compute instead of waiting for a core; 0: the same priority", WORKERS),
        f("no_thread_binding", click.BOOL, False, "CPU workers of one rank whose engine has two torch threads on "
          "the two cores they may use: leave them to the scheduler instead of binding one to each core (bound, two "
          "workers sharing the cores never find both of one's threads on one core, where they take turns)",
          WORKERS, is_bool=True),
        f("huge_pages", click.BOOL, False, "once ready, collapse the well-filled parts of the worker's anonymous "
          "memory (weights, a colocated worker's KV pool, step buffers) into transparent huge pages (~2.7 s per GiB "
          "at start; Linux 6.1+). On a VM with shadowed page tables, memory left alone for seconds is slow to touch "
          "again page by page, and the first prompt after a pause paid it for every page its step read (a 240-token "
          "prompt after 10 s idle had its first token ~1.5x sooner with it)", WORKERS, is_bool=True),
        f("kv_transport", s, "auto", "KV transports: a decode worker offers them fastest first, a prefill "
          "worker may use them; auto or a comma list of shm, tcp, nccl, cuda_ipc", WORKERS),
        f("lora_modules", s, "", "LoRA adapters to serve (with --enable-lora), as name=path pairs separated by "
          "commas: PEFT adapter directories; requests name them (gRPC lora, HTTP model)", WORKERS),
        f("role", click.Choice(["decode", "both"]), "decode", "decode only, or colocated prefill + decode",
          frozenset({"decode"}), up=False),
        f("lease_ttl_s", fl, 30.0, "seconds a reservation waits for its KV before its pages are freed",
          frozenset({"decode"})),
        f("verify_checksum", click.BOOL, False, "send a CRC32 of each request's pages for the decode side to "
          "verify", frozenset({"prefill"}), is_bool=True),
        # The gateway.
        f("queue_limit", i, 256, "unfinished requests (queued or running, all gateways) before "
          "RESOURCE_EXHAUSTED", gw),
        f("gateway_id", s, "", "id in Redis (default: gw-<random>); every gateway needs its own", gw, up=False),
        f("max_attempts", i, 3, "tries per request when a worker dies under it; then UNAVAILABLE", gw),
        f("prefix_routing", click.Choice(["directory", "load"]), "directory", "how a request's workers are chosen: "
          "directory, by load less what its prompt's cached prefix saves on each worker (the prefix directory the "
          "workers keep in Redis, the same for every gateway); load, by load alone", gw),
        f("disaggregation", click.Choice(["always", "never", "auto"]), "always", "where a prompt placed on a decode "
          "worker is prefilled: always on a prefill worker (its KV handed off), never (on the decode worker itself; "
          "no prefill worker needed), or auto: per request, on the decode worker when what it would compute (the "
          "prompt less its cached head) is at most --local-prefill-tokens or the prefill workers are backed up "
          "(--prefill-queue-limit), else on a prefill worker", gw),
        f("local_prefill_tokens", i, 256, "with --disaggregation auto: prompts with at most this many tokens left "
          "to compute on their decode worker are prefilled there (lowered to the prompt tokens one of its steps "
          "takes under --target-tpot-ms)", gw),
        f("prefill_queue_limit", fl, 0.0, "with --disaggregation auto: when the least busy prefill worker has this "
          "many requests ahead, a decode worker prefilling none of this gateway's prompts prefills the next itself, "
          "however long (TTFT for TPOT, when the prefill workers are overloaded); 0: off", gw),
        f("http_port", i, -1, "port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
          "/v1/models, /tokenize, /detokenize, /version, /health) on --host; -1: off, 0: any free port (up: 8000)", gw),
        f("generation_config", s, "auto", "defaults for the sampling fields a request leaves unset: auto, the "
          "model's generation_config.json (its temperature, top_p, top_k, min_p, repetition_penalty, "
          "max_new_tokens); vllm, none (the server's own, vLLM's name for it); or a directory holding a "
          "generation_config.json", gw),
        f("tool_call_parser", click.Choice(["", *TOOL_PARSERS]), "", "how the model writes tool calls, by vLLM's "
          "names: its output is parsed into tool_calls for tool_choice auto (with --enable-auto-tool-choice)", gw),
        f("enable_auto_tool_choice", click.BOOL, False, "allow tool_choice auto (the default with tools): the "
          "model decides whether to call, and --tool-call-parser reads its calls", gw, is_bool=True),
        f("reasoning_parser", click.Choice(["", *REASONING_PARSERS]), "", "how a reasoning model writes its "
          "thinking (<think>...</think>): it comes as reasoning_content, apart from the answer, and structured "
          "output constrains the answer only", gw),
        f("http_max_connections", i, 2048, "HTTP connections served at once; one more is answered 503 at once",
          gw),
        f("http_header_timeout_s", fl, 10.0, "seconds an HTTP request's line and headers may take to arrive, "
          "from the connection's start or the previous response's end; then the connection is closed "
          "(with 408 if part of a request came)", gw),
        f("http_body_timeout_s", fl, 30.0, "seconds an HTTP request's body may take to arrive (else 408); its "
          "size is bounded by --max-message-mb (else 413), checked while it is read", gw),
    ]


FLAGS: list[Flag] = engine_flags() + _flags() + limit_flags()
BY_NAME = {flag.name: flag for flag in FLAGS}
# Defaults that differ by process kind.
KIND_DEFAULTS = {"gateway": {"host": "127.0.0.1", "port": 50051}, "decode": {"host": "127.0.0.1", "port": 0},
                 "prefill": {"host": "127.0.0.1", "port": 0}}
# Help that differs by process kind.
KIND_HELP = {"gateway": {"model": "the model the workers serve (its tokenizer and limits)",
                         "priority_aging_per_s": "priority points a queued request gains per second (the "
                         "Redis queue's order; give every gateway and worker the same)"}}


def options(kind: str) -> list[click.Option]:
    """The click options of a process kind (decode, prefill, gateway)."""
    defaults, helps = KIND_DEFAULTS.get(kind, {}), KIND_HELP.get(kind, {})
    return [flag.click_option(defaults.get(flag.name), helps.get(flag.name)) for flag in FLAGS if kind in flag.kinds]


def up_options() -> list[click.Option]:
    """Every flag ``up`` takes: each one any of its children takes (the gateway's address for --host/--port)."""
    defaults = {"host": "127.0.0.1", "port": 50051, "http_port": 8000}
    return [flag.click_option(defaults.get(flag.name)) for flag in FLAGS if flag.up]


def forward(args, kind: str, skip: frozenset = frozenset()) -> tuple[list[str], dict[str, str]]:
    """Command line and environment that hand ``up``'s flag values to a child of ``kind``."""
    argv: list[str] = []
    env: dict[str, str] = {}
    for flag in FLAGS:
        if not flag.up or flag.name in skip or kind not in (flag.up_to or flag.kinds):
            continue
        value = getattr(args, flag.name)
        # Empty text is passed on too: the child's own SPLITSERVE_* variables must not win over it.
        if value is None or (flag.secret and value == ""):
            continue
        if flag.secret:
            env[flag.envvar] = str(value)
        else:
            argv += flag.argv(value)
    return argv, env
