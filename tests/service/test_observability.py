"""Watching a stack, with real processes: Redis, a gateway, a prefill and a decode worker.

* Token counters add up: summed over every process's scrape (as a dashboard sums its targets),
  ``vllm:prompt_tokens`` and ``vllm:generation_tokens`` equal the tokens the clients were served.
* Every series carries ``model_name``, the public name GetModelInfo reports.
* Every query of the Grafana dashboard (deploy/grafana) names a metric the processes export,
  under the names Prometheus stores (vLLM's colons kept whatever format it asks for).
* Liveness (``""``) and readiness (the process's own service) are apart: a draining process is
  alive and not ready.
* Every process froze its start-up heap before it served (splitserve/common/gc_heap.py): no full garbage
  collection walks the loaded model and libraries while requests wait.
"""
from __future__ import annotations

import json
import re
import signal
import urllib.request
from pathlib import Path

import pytest

from tests.harness.prompts import mixed_prompts
from tests.harness.stack import NOT_SERVING, SERVING, health, start_stack
from tests.harness.streams import join_all, run_streams, wait_until
from tests.harness.tools import PROMETHEUS_ACCEPT, scrape, scrape_samples
from splitserve.worker.engine_loop import SLOW_STEP_ENV

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "splitserve.json"
READINESS = {"gateway": "splitserve.v1.Generation", "prefill": "splitserve.v1.PrefillWorker",
             "decode": "splitserve.v1.DecodeWorker"}


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, tmp_path_factory):
    # Slow decode steps (20 ms) keep the last test's stream decoding while both processes drain.
    with start_stack(tiny_model_dirs["llama"], tmp_path_factory, prefill=1, decode=1,
                     role_env={"decode": {SLOW_STEP_ENV: "0.02"}},
                     worker_args=["--drain-timeout-s", "120"], gateway_args=["--drain-timeout-s", "120"]) as st:
        yield st


@pytest.fixture(scope="module")
def served(stack):
    """Every process's scrape before and after requests of mixed lengths ran to their end, and the
    usage each client was told (prompt 5-60 tokens, 1-12 generated)."""
    before = {name: scrape(port) for name, port in stack.metrics_ports.items()}
    finals = []
    for i, prompt in enumerate(mixed_prompts(6, seed=171, lo=5, hi=60)):
        *_, final = stack.client.generate(prompt, max_tokens=1 + 2 * i, temperature=0.0, ignore_eos=True,
                                          timeout=120)
        assert final.finish_reason == "length"
        finals.append(final)
    after = {name: scrape(port) for name, port in stack.metrics_ports.items()}
    return before, after, finals


def total(scrapes: dict[str, dict[str, float]], name: str) -> float:
    """``name`` summed over every process and every label set, as ``sum(name)`` over the targets."""
    return sum(value for samples in scrapes.values() for key, value in samples.items() if key.split("{")[0] == name)


def test_token_counters_summed_over_every_process_equal_the_tokens_served(stack, served):
    before, after, finals = served
    assert set(after) == {"gateway", "prefill", "decode"}
    prompt = sum(f.usage.prompt_tokens for f in finals)
    generated = sum(f.usage.completion_tokens for f in finals)
    assert prompt > 0 and generated == sum(1 + 2 * i for i in range(len(finals)))
    delta = lambda name: total(after, name) - total(before, name)  # noqa: E731
    assert delta("vllm:prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens_total") == generated
    # The engines count their work under their own names: here (no retry, nothing cancelled) the
    # prefill worker computed each prompt once and sampled each first token, the decode worker the rest.
    assert delta("splitserve:engine_prompt_tokens_total") == prompt
    engine = {name: after[name].get("splitserve:engine_generation_tokens_total", 0.0) -
              before[name].get("splitserve:engine_generation_tokens_total", 0.0) for name in after}
    assert engine == {"gateway": 0.0, "prefill": len(finals), "decode": generated - len(finals)}


def test_workers_export_where_their_step_time_went(stack, served):
    """``splitserve:engine_step_seconds{phase}`` and ``splitserve:engine_steps`` (splitserve.engine.step_phases):
    both workers ran steps and every phase of them took time; no speculative decoding, so no
    proposals; the gateway runs no engine."""
    before, after, _ = served
    for name in ("prefill", "decode"):
        delta = lambda key: after[name].get(key, 0.0) - before[name].get(key, 0.0)  # noqa: E731
        assert delta("splitserve:engine_steps_total") > 0, name
        for phase in ("schedule", "prepare", "forward", "sample", "update"):
            assert delta(f"splitserve:engine_step_seconds_total{{phase={phase}}}") > 0, (name, phase)
        assert after[name].get("splitserve:engine_step_seconds_total{phase=propose}", 0.0) == 0.0, name
    assert not any(key.startswith("splitserve:engine_step") for key in after["gateway"])


def test_every_series_carries_the_public_model_name(stack, served):
    public = stack.client.model_info().model
    assert public == Path(stack.model).name  # a local directory by its last component only
    for name, port in stack.metrics_ports.items():
        samples = scrape_samples(port)
        assert any(s.name.startswith("vllm:") for s in samples), name
        unlabelled = sorted({s.name for s in samples if s.labels.get("model_name") != public})
        assert not unlabelled, f"{name}: series without model_name={public!r}: {unlabelled}"


def test_metrics_keep_vllm_names_whatever_format_a_scraper_asks_for(stack):
    """Prometheus asks for OpenMetrics first; the processes answer in the classic text format,
    where the colons of vLLM's names survive (splitserve/common/metrics.py)."""
    for name, port in stack.metrics_ports.items():
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": PROMETHEUS_ACCEPT})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4"), name
            text = response.read().decode()
        assert re.search(r"^(vllm|splitserve):\w+", text, re.M), name
        assert not re.search(r"^(vllm|splitserve)_", text, re.M), name


# ---- the dashboard ------------------------------------------------------------------------

_STRING = r'"(?:[^"\\]|\\.)*"'
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_MATCHERS = r'\{(?:[^}"]|' + _STRING + r')*\}'  # {a="b", c=~"{d}"}: braces inside strings too
_TOKENS = re.compile("(?P<string>" + _STRING + ")|(?P<labels>" + _MATCHERS + r")|(?P<range>\[[^\]]*\])|"
                     r"(?P<number>\d[\w.]*)|(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)(?P<call>\s*\()?")
# Aggregations may take `by (...)` between their name and their parenthesis; the rest are operators.
_KEYWORDS = {"sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "group",
             "count_values", "limitk", "limit_ratio", "and", "or", "unless", "bool", "offset", "inf", "nan",
             "by", "without", "on", "ignoring", "group_left", "group_right"}


def metric_selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name, its label matchers or "") of each series a PromQL expression reads. Label
    names (in matchers and in by/on/... lists), strings, ranges, functions, aggregations and
    operators are not metric names; a histogram's ``_bucket``/``_sum``/``_count`` stay on the name.
    Grafana's ``label_values(metric, label)`` reads ``metric``."""
    expr = re.sub(r"label_values\(\s*([^,()]+?)\s*,\s*\w+\s*\)", r"\1", expr)
    expr = _LABEL_LISTS.sub(" ", expr)
    found: list[tuple[str, str]] = []
    attach = False  # the last token was a metric name: matchers right after it are its own
    for token in _TOKENS.finditer(expr):
        if token["labels"] is not None and attach:
            found[-1] = (found[-1][0], token["labels"])
        elif token["ident"] is not None and token["call"] is None and token["ident"] not in _KEYWORDS:
            found.append((token["ident"], ""))
            attach = True
            continue
        attach = False
    return found


def dashboard_queries(dashboard: dict) -> list[str]:
    """The PromQL of every panel (rows' nested ones too) and every query variable."""
    queries = []

    def panels(items):
        for panel in items:
            queries.extend(target["expr"] for target in panel.get("targets", []) if target.get("expr"))
            panels(panel.get("panels", []))
    panels(dashboard["panels"])
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def test_metric_selectors_reads_promql():
    # The checker itself: what it must find, and what it must not mistake for a metric.
    expr = ('histogram_quantile(0.9, sum by (le) (rate(vllm:x_seconds_bucket{model_name=~"$m", a="{b}"}'
            '[$__rate_interval]))) / on(instance) group_left max without (job) (up_total) > bool 0.5 '
            'and count(foo:bar offset 5m)')
    assert metric_selectors(expr) == [("vllm:x_seconds_bucket", '{model_name=~"$m", a="{b}"}'),
                                      ("up_total", ""), ("foo:bar", "")]
    assert metric_selectors("label_values(splitserve:worker_info, model_name)") == [("splitserve:worker_info", "")]


def test_every_dashboard_query_names_a_metric_the_processes_export(stack, served):
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dashboard)
    # Scraped as Prometheus scrapes (its Accept header): the names it would store.
    exported = {s.name for port in stack.metrics_ports.values() for s in scrape_samples(port)}
    wanted: set[str] = set()
    for query in queries:
        selectors = metric_selectors(query)
        assert selectors, f"no metric in {query!r}"
        wanted |= {name for name, _ in selectors}
        if not query.startswith("label_values"):  # panels follow the dashboard's model selector
            assert all('model_name=~"$model_name"' in labels for _, labels in selectors), query
    assert not wanted - exported, f"the dashboard reads metrics nobody exports: {sorted(wanted - exported)}"
    # What the issue asks a dashboard to show is there (a panel lost in an edit fails here).
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:request_time_per_output_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_success_total", "splitserve:queue_depth", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "splitserve:kv_transfer_bytes_total",
                 "splitserve:kv_handoff_latency_seconds_bucket", "splitserve:kv_lease_expiries_total",
                 "splitserve:request_retries_total", "splitserve:slow_readers_cut_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert name in wanted, name


# ---- liveness and readiness ----------------------------------------------------------------

def addresses(stack) -> dict[str, str]:
    return {"gateway": stack.gateway_address, **stack.addresses}


def test_every_process_froze_its_startup_heap_before_serving(stack):
    for name, path in stack.log_paths.items():
        messages = [json.loads(line).get("message", "") for line in path.read_text().splitlines()
                    if line.startswith("{")]
        frozen = [int(m.split()[0]) for m in messages if m.endswith("start-up objects frozen out of the garbage "
                                                                      "collector's sight")]
        assert len(frozen) == 1, (name, frozen)
        assert frozen[0] > 50000, (name, frozen)  # torch, grpc, transformers: far more than that


def test_alive_and_ready_while_serving(stack):
    for name, address in addresses(stack).items():
        assert health(address) == SERVING, name
        assert health(address, service=READINESS[name]) == SERVING, name


def test_a_draining_process_is_alive_but_not_ready(stack, llama_reference):
    """Last in the module: SIGTERM the gateway and the decode worker while a request decodes;
    both stop being ready at once, stay alive while they finish it, then exit cleanly."""
    [stream] = run_streams(stack, "drain", mixed_prompts(1, seed=172, lo=10, hi=10), max_tokens=300)
    wait_until(lambda: len(stream.tokens) >= 3, 60, "the stream to be decoding")
    draining = {name: addresses(stack)[name] for name in ("gateway", "decode")}
    for name in draining:
        stack.procs[name].send_signal(signal.SIGTERM)
    for name, address in draining.items():
        wait_until(lambda: health(address, service=READINESS[name]) == NOT_SERVING, 10, f"{name} not ready")
        assert health(address) == SERVING, f"{name} is draining, not dead"
    assert stream.is_alive() and len(stream.tokens) < 300, "the drain ended before it could be observed"
    join_all([stream])
    assert stream.final is not None and stream.tokens == llama_reference.greedy(stream.prompt, 300)
    for name in draining:
        assert stack.procs[name].wait(60) == 0, name
