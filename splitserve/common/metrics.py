"""Prometheus metrics of every splitserve process, under vLLM's names where one exists.

Each process owns one registry and serves it on ``--metrics-port`` (-1 = off, 0 = a free
port, reported through GetServerInfo). Gauges of the
engine are refreshed on the engine-loop thread (the engine is not thread-safe), counters and
histograms are updated where the events happen.

/metrics always answers in Prometheus's classic text format, whatever the scraper's Accept
header asks: prometheus_client 0.26's OpenMetrics output turns the colons of sample names into
underscores under Prometheus 2's ``escaping=underscores`` (prometheus/client_python#1177), so
Prometheus would store ``vllm_prompt_tokens_total`` and every vLLM dashboard would find nothing.

Every series carries ``model_name``: the served model's public name (what GetModelInfo and
/v1/models call it), as vLLM labels all its series, so vLLM's dashboards and ours filter on it.

Sums across processes add up. A stack's scrapes are summed by the dashboards (``sum(rate(...))``
over every target), so a count kept by two processes would be counted twice. Each fact is
counted once, by the process that owns it:

* ``vllm:prompt_tokens`` / ``vllm:generation_tokens`` (vLLM's names, what its dashboards read)
  are the tokens *served*: counted by the gateway once per request when it ends, the prompt as
  admitted and the tokens streamed to the client. Workers never export them.
* ``splitserve:engine_prompt_tokens`` / ``splitserve:engine_generation_tokens`` are engine
  *work*, per worker: prompt tokens a prefill (or colocated) worker computed, tokens an engine
  sampled (a prefill worker samples the first token, the decode worker the rest). They exceed
  the served counts when work is lost: a retried request's prompt is prefilled again, a
  cancelled request's last tokens are sampled but never streamed.
* ``vllm:request_success``, the request latency histograms and the Redis queue depth are the
  gateway's; the engine gauges (running, waiting, KV usage), preemptions and prefix-cache
  counters are per worker, and a prefill and a decode worker each count a request they both hold.
* ``vllm:spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens`` (vLLM's
  names) count speculative decoding's proposals and the accepted ones on the worker that decodes
  (``--speculative-method``); acceptance rate = accepted / draft tokens.
"""
from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

# Seconds: from a 2-core CPU box to a GPU, first tokens land between milliseconds and seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0)
# Tokens per request (prompt or output), vLLM's 1-2-5 steps.
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class ModelRegistry(CollectorRegistry):
    """A registry whose every sample carries ``model_name`` (added when scraped, so no metric
    definition can forget it)."""

    def __init__(self, model_name: str):
        super().__init__()
        self.model_name = model_name

    def collect(self):
        for family in super().collect():  # fresh families on every collect: safe to edit
            family.samples = [s._replace(labels={"model_name": self.model_name, **s.labels}) for s in family.samples]
            yield family


# The (tier, op) series of splitserve:kv_offload_pages: the keys of the engine's
# ``OffloadStats.by_tier()`` (splitserve/engine/kv_offload.py).
OFFLOAD_SERIES = (("host", "stored"), ("host", "loaded"), ("host", "dropped"), ("disk", "stored"),
                  ("disk", "loaded"), ("disk", "dropped"), ("disk", "corrupt"))


class EngineMetrics:
    """What a worker's engine reports (vLLM names for the engine's state, splitserve's for its
    token work: see the module docstring)."""

    def __init__(self, registry: CollectorRegistry, role: str):
        labels = {"role": role}
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", registry=registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting in the engine", registry=registry)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV pages in use (0-1)", registry=registry)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions", registry=registry)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=registry)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   registry=registry)
        self.prompt_tokens = Counter("splitserve:engine_prompt_tokens",
                                     "Prompt tokens this engine computed (a retried request's again)",
                                     registry=registry)
        self.generation_tokens = Counter("splitserve:engine_generation_tokens",
                                         "Tokens this engine sampled (streamed or not)", registry=registry)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Speculative proposals verified (one per "
                                   "sequence and step with at least one proposed token)", registry=registry)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Tokens proposed and verified",
                                         registry=registry)
        self.spec_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens",
                                            "Proposed tokens the model accepted", registry=registry)
        self.lease_expiries = Counter("splitserve:kv_lease_expiries",
                                      "Reservations freed because their KV did not arrive in time (decode)",
                                      registry=registry)
        self.lease_renewals = Counter("splitserve:kv_lease_renewals",
                                      "Reservations kept past a lease because their prefill was still under way "
                                      "(decode)", registry=registry)
        self.grammar_cache_bytes = Gauge("splitserve:grammar_cache_bytes",
                                         "Bytes of compiled structured-output grammars kept for reuse (bounded by "
                                         "--grammar-cache-mb)", registry=registry)
        self.grammar_cache_hits = Counter("splitserve:grammar_cache_hits",
                                          "Constrained requests whose grammar was compiled already", registry=registry)
        self.grammar_cache_misses = Counter("splitserve:grammar_cache_misses",
                                            "Constrained requests whose grammar was compiled for them",
                                            registry=registry)
        self.steps_overlapped = Counter("splitserve:engine_steps_overlapped",
                                        "Steps launched before the tokens of the step before were read (async "
                                        "scheduling, --async-scheduling)", registry=registry)
        self.pages_set_aside = Gauge("splitserve:kv_pages_set_aside",
                                     "Pages of ended reservations held back while a sender in another process "
                                     "is still copying into them (decode)", registry=registry)
        self.step_seconds = Counter("splitserve:engine_step_seconds",
                                    "Wall seconds of the engine's steps by phase: schedule, propose, prepare, "
                                    "forward, sample, update (splitserve.engine.step_phases)", ["phase"],
                                    registry=registry)
        self.steps = Counter("splitserve:engine_steps", "Engine steps that ran the model", registry=registry)
        self.offload_pages = Counter("splitserve:kv_offload_pages",
                                     "Pages of the KV tiers below the pool (--kv-offloading-size, --kv-offloading-"
                                     "disk-size), by tier (host, disk) and op: stored (the host tier: evicted from "
                                     "the pool; disk: let go by the host tier), loaded (brought back for a prefix "
                                     "hit), dropped (least recently used, for room), corrupt (disk files that did not "
                                     "check out)", ["tier", "op"], registry=registry)
        self.offload_load_seconds = Counter("splitserve:kv_offload_load_seconds",
                                            "Seconds spent bringing KV pages back from the tiers", registry=registry)
        for tier, op in OFFLOAD_SERIES:  # at 0 from the start (and with the tiers off)
            self.offload_pages.labels(tier=tier, op=op)
        self.role = Gauge("splitserve:worker_info", "Constant 1, labelled with the worker's role",
                          list(labels), registry=registry)
        self.role.labels(**labels).set(1)
        self._seen = {"num_preemptions": 0, "prefix_queries": 0, "prefix_hits": 0, "spec_drafts": 0,
                      "spec_draft_tokens": 0, "spec_accepted_tokens": 0, "grammar_hits": 0, "grammar_misses": 0,
                      "steps_overlapped": 0}
        self._seen_phases: dict[str, float] = {}  # the engine's StepPhases at the last refresh

    def refresh(self, engine) -> None:
        """Copy the engine's counters into the metrics; runs on the engine thread."""
        stats = engine.stats()
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.kv_usage.set(stats["kv_usage"])
        self.refresh_counters(engine)

    def refresh_counters(self, engine) -> None:
        """The counters alone (cheap: a decode worker runs it after every step, so they are
        current by the time the step's tokens are streamed)."""
        spec = engine.scheduler.spec_stats
        totals = {"num_preemptions": engine.scheduler.num_preemptions,
                  "prefix_queries": engine.kv.prefix_stats.queries, "prefix_hits": engine.kv.prefix_stats.hits,
                  "spec_drafts": spec.num_drafts, "spec_draft_tokens": spec.num_draft_tokens,
                  "spec_accepted_tokens": spec.num_accepted_tokens,
                  "grammar_hits": engine.grammars.hits, "grammar_misses": engine.grammars.misses,
                  "steps_overlapped": engine.overlap.num_overlapped if engine.overlap is not None else 0}
        self.grammar_cache_bytes.set(engine.grammars.cached_bytes)
        for name, counter in (("num_preemptions", self.preemptions), ("prefix_queries", self.prefix_queries),
                              ("prefix_hits", self.prefix_hits), ("spec_drafts", self.spec_drafts),
                              ("spec_draft_tokens", self.spec_draft_tokens),
                              ("spec_accepted_tokens", self.spec_accepted_tokens),
                              ("grammar_hits", self.grammar_cache_hits),
                              ("grammar_misses", self.grammar_cache_misses),
                              ("steps_overlapped", self.steps_overlapped)):
            counter.inc(max(0, totals[name] - self._seen[name]))
            self._seen[name] = totals[name]
        tier = engine.kv.offload
        if tier is not None:
            for (name, op), total in tier.stats.by_tier().items():
                seen = f"offload_{name}_{op}"
                self.offload_pages.labels(tier=name, op=op).inc(max(0, total - self._seen.get(seen, 0)))
                self._seen[seen] = total
            self.offload_load_seconds.inc(max(0.0, tier.stats.load_seconds - self._seen.get("offload_seconds", 0.0)))
            self._seen["offload_seconds"] = tier.stats.load_seconds
        phases = engine.runner.phases
        self.steps.inc(max(0, phases.steps - self._seen_phases.get("steps", 0)))
        self._seen_phases["steps"] = phases.steps
        for phase, seconds in phases.seconds().items():
            self.step_seconds.labels(phase=phase).inc(max(0.0, seconds - self._seen_phases.get(phase, 0.0)))
            self._seen_phases[phase] = seconds


class TransferMetrics:
    """KV handoffs on a prefill worker (splitserve's own)."""

    def __init__(self, registry: CollectorRegistry, transports: tuple[str, ...] | list[str] = ()):
        """``transports``: the worker's own, whose series are exported at 0 from the start (a
        failure count that appears only with the first failure reads as "no data", not as 0)."""
        self.bytes = Counter("splitserve:kv_transfer_bytes", "KV bytes written to decode workers", ["transport"],
                             registry=registry)
        self.seconds = Counter("splitserve:kv_transfer_seconds", "Seconds spent copying and flushing KV",
                               ["transport"], registry=registry)
        self.failures = Counter("splitserve:kv_transfer_failures", "KV handoffs that failed", ["transport"],
                                registry=registry)
        self.handoff = Histogram("splitserve:kv_handoff_latency_seconds",
                                 "Prefill request received to KV flushed and first token sampled",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        for transport in transports:
            for counter in (self.bytes, self.seconds, self.failures):
                counter.labels(transport=transport)


class GatewayMetrics:
    """Request latencies as the client sees them (vLLM names and definitions)."""

    def __init__(self, registry: CollectorRegistry):
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Request arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Gap between consecutive streamed tokens",
                             buckets=TOKEN_LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Per request: (e2e - ttft) / (output tokens - 1)", buckets=TOKEN_LATENCY_BUCKETS,
                              registry=registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request arrival to its end",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time waiting in the queue",
                               buckets=LATENCY_BUCKETS, registry=registry)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "Prefill (including KV handoff) time",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.decode = Histogram("vllm:request_decode_time_seconds", "First token to the end",
                                buckets=LATENCY_BUCKETS, registry=registry)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason", ["finished_reason"],
                               registry=registry)
        # The stack's only vllm:prompt_tokens / vllm:generation_tokens (module docstring).
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of the requests that ended",
                                     registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens streamed to clients", registry=registry)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request",
                                               buckets=TOKEN_COUNT_BUCKETS, registry=registry)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Tokens streamed per request", buckets=TOKEN_COUNT_BUCKETS,
                                                   registry=registry)
        self.queue_depth = Gauge("splitserve:queue_depth", "Requests waiting in the Redis queue", registry=registry)
        self.retries = Counter("splitserve:request_retries", "Attempts that failed because a worker died, froze "
                               "or voided its handoff (the request went back to the queue or gave up)",
                               registry=registry)
        self.prefill_placements = Counter("splitserve:prefill_placements", "Where prompts placed on a decode worker "
                                          "were prefilled (remote: a prefill worker; local: the decode worker) and "
                                          "the rule that chose it (--disaggregation)", ["where", "reason"],
                                          registry=registry)
        self.unread_output = Gauge("splitserve:unread_output_bytes", "Generated output waiting at the gateway for "
                                   "clients that have not taken it (estimated bytes; --max-buffered-bytes)",
                                   registry=registry)
        self.untrusted_workers = Gauge("splitserve:untrusted_workers", "Worker records in the Redis registry "
                                       "the gateway ignores: unsigned, or signed with another --internal-token",
                                       registry=registry)
        self.slow_readers_cut = Counter("splitserve:slow_readers_cut", "Requests ended because their client did "
                                        "not read its stream (--slow-reader-timeout-s, "
                                        "--max-buffered-tokens-per-stream)", registry=registry)


def serve_metrics(port: int, host: str = "0.0.0.0", model_name: str = "") -> tuple[CollectorRegistry, str]:
    """A fresh registry labelling every series with ``model_name`` (the public name, see
    ``public_model_name``), served over HTTP on ``port`` (-1: not served; 0: any free port), on
    ``host`` (all interfaces when the process listens on all). Returns (registry, address
    actually listened on)."""
    host = "0.0.0.0" if host in ("0.0.0.0", "") else host
    registry = ModelRegistry(model_name)
    if port < 0:
        return registry, ""
    # The address family of ``host`` (an IPv6 address or a name that resolves only to one works too).
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsServer", (_ThreadingServer,), {"address_family": family})
    server = make_server(host, port, _classic_text(make_wsgi_app(registry)), server_class,
                         handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return registry, f"{host}:{server.server_port}"


def _classic_text(app):
    """``app`` asked for no format in particular: the classic text format, colons kept (module docstring)."""
    def classic(environ, start_response):
        environ.pop("HTTP_ACCEPT", None)
        return app(environ, start_response)
    return classic


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds the process open


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # one line per scrape would drown the process's log
        pass


def public_model_name(model: str) -> str:
    """What ModelInfo and every metric call the model: a local checkpoint directory by its last
    component only (the server's file system is nobody's business), a hub id or built-in name
    as given. Every process of a stack computes it from its own ``--model``."""
    from pathlib import Path
    path = Path(model).expanduser()
    return path.resolve().name if path.exists() else model
