"""bench/compare.py and the load generator it shares with bench/serve.py: the pure parts on
hand-made data, and one comparison end to end (--quick) on the tiny model. No timing asserted."""
import json
import os
import random
import subprocess
import sys
import types

import grpc
import pytest

from bench import compare
from bench.common import wait_until_quiet
from bench.metrics import metric_values
from splitserve.cli.loadgen import run_load, summarize, timeline_breakdown
from bench.serve import parse_rates, summarize_rounds
from splitserve.cli.workloads import BenchRequest, fresh_tokens, interference, mixed, poisson_offsets, prefix_probe


def test_schedule_warms_up_every_arm_then_alternates():
    rounds = compare.schedule(["A", "B"], pairs=3)
    assert [(r.index, r.arm) for r in rounds] == [(0, "A"), (0, "B"), (1, "A"), (1, "B"), (2, "A"), (2, "B"),
                                                  (3, "A"), (3, "B")]
    assert [r.warmup for r in rounds] == [True, True] + [False] * 6
    with pytest.raises(ValueError):
        compare.schedule(["A", "B"], pairs=0)
    with pytest.raises(ValueError):
        compare.schedule(["A", "A"], pairs=2)


def test_poisson_offsets():
    assert poisson_offsets(4, float("inf")) == [0.0] * 4
    offsets = poisson_offsets(2000, 4.0, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets == poisson_offsets(2000, 4.0, seed=1) != poisson_offsets(2000, 4.0, seed=2)
    assert offsets[-1] / 1999 == pytest.approx(0.25, rel=0.1)  # mean gap 1/rate
    # The same gaps bench/serve.py always drew: Random(seed).expovariate(rate) after each request.
    rng = random.Random(1)
    assert offsets[1] == pytest.approx(rng.expovariate(4.0))
    with pytest.raises(ValueError):
        poisson_offsets(3, 0.0)


def test_fresh_tokens_keeps_the_work_and_changes_the_prompts():
    base = mixed(8, 1000, seed=0)
    again = fresh_tokens(base, 1000, seed=1)
    assert [(len(r.prompt_token_ids), r.max_tokens, r.kind) for r in again] == \
        [(len(r.prompt_token_ids), r.max_tokens, r.kind) for r in base]
    assert all(a.prompt_token_ids[:16] != b.prompt_token_ids[:16] for a, b in zip(base, again))
    assert fresh_tokens(base, 1000, seed=1) == again


def test_interference_workload():
    requests, offsets = interference(3, 2, 1000, seed=5, decode_tokens=40, long_prompt=(300, 400),
                                     long_start_s=1.0, long_every_s=2.5)
    kinds = [r.kind for r in requests]
    assert kinds == ["decode"] * 3 + ["long"] * 2
    assert offsets == [0.0, 0.0, 0.0, 1.0, 3.5]
    assert all(32 <= len(r.prompt_token_ids) <= 64 and r.max_tokens == 40 for r in requests[:3])
    assert all(300 <= len(r.prompt_token_ids) <= 400 and r.max_tokens == 8 for r in requests[3:])
    assert all(100 <= t < 1000 for r in requests for t in r.prompt_token_ids)
    assert interference(3, 2, 1000, seed=5, decode_tokens=40, long_prompt=(300, 400))[0] == requests


def test_prefix_probe_hits_share_the_prefix_and_misses_do_not():
    probe = prefix_probe(3, 64, 1000, seed=2, suffix_tokens=8, max_tokens=4)
    hit, miss = probe["hit"], probe["miss"]
    assert [r.kind for r in hit] == ["first", "hit", "hit", "hit"] and [r.kind for r in miss] == ["miss"] * 3
    prefix = hit[0].prompt_token_ids[:64]
    assert all(r.prompt_token_ids[:64] == prefix and len(r.prompt_token_ids) == 72 for r in hit)
    assert len({tuple(r.prompt_token_ids) for r in hit}) == 4  # unique suffixes
    # Control: same lengths, no two misses (nor a miss and the hit prefix) share even one 16-token block.
    assert all(len(r.prompt_token_ids) == 72 for r in miss)
    firsts = {tuple(r.prompt_token_ids[:16]) for r in miss} | {tuple(prefix[:16])}
    assert len(firsts) == 4
    # A new seed (a new round) gets a new prefix.
    assert prefix_probe(3, 64, 1000, seed=3)["hit"][0].prompt_token_ids[:64] != prefix


def _record(sent, times, kind="", error=None):
    return {"sent": sent, "token_times": times, "error": error, "kind": kind, "prompt_tokens": 1, "max_tokens": 1}


def test_summarize_rounds_pools_requests_and_wall_time():
    round1 = ([_record(0.0, [0.1, 0.2, 0.3], "a"), _record(0.0, [0.4], "b")], 1.0)
    round2 = ([_record(5.0, [5.3, 5.5], "a"), _record(5.0, [], "b", error="UNAVAILABLE")], 3.0)
    s = summarize_rounds([round1, round2], by_kind=True)
    assert s["rounds"] == 2 and s["completed"] == 3 and s["failed"] == 1
    assert s["output_tokens"] == 6 and s["output_tokens_per_s"] == pytest.approx(6 / 4.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(300.0)  # TTFTs 100, 400, 300
    assert s["ttft_ms"]["max"] == pytest.approx(400.0)
    assert s["by_kind"]["a"]["tpot_ms"]["mean"] == pytest.approx(150.0)  # 100 and 200
    assert s["by_kind"]["b"]["completed"] == 1 and s["by_kind"]["b"]["failed"] == 1
    with pytest.raises(ValueError):
        summarize_rounds([])


def test_timeline_breakdown_sets_the_gateway_view_beside_the_client_one():
    def rec(sent, first, timeline, retries=0):
        r = _record(sent, [first, first + 0.1])
        r.update(timeline=timeline, retries=retries)
        return r
    t = {"queued_ms": 5.0, "prefill_ms": 100.0, "kv_transfer_ms": 2.0, "first_token_ms": 150.0}
    records = [rec(0.0, 0.2, t), rec(1.0, 1.2, {**t, "queued_ms": 15.0}),
               rec(2.0, 9.0, {**t, "queued_ms": 1000.0}, retries=3),  # retried: left out
               rec(3.0, 3.3, None)]  # no timeline (in-process backend): left out
    b = timeline_breakdown(records)
    assert b["requests"] == 2 and b["queued_ms"] == pytest.approx(10.0) and b["prefill_ms"] == 100.0
    assert b["client_ttft_ms"] == pytest.approx(200.0) and b["client_minus_gateway_ttft_ms"] == pytest.approx(50.0)
    assert timeline_breakdown([rec(0.0, 0.2, None)]) == {}


def test_summarize_names_the_slowest_first_token():
    records = [_record(10.0, [10.1, 10.2], "a"), _record(12.0, [13.5], "b"), _record(13.0, [], "a", error="E"),
               _record(14.0, [14.2], "a")]
    records[1]["timeline"] = {"queued_ms": 2.0, "first_token_ms": 1490.0}
    slowest = summarize(records, 5.0, float("inf"), float("inf"))["slowest_ttft"]
    assert slowest["index"] == 1 and slowest["sent_s"] == pytest.approx(2.0)
    assert slowest["ttft_ms"] == pytest.approx(1500.0) and slowest["timeline"]["first_token_ms"] == 1490.0
    assert summarize([records[2]], 1.0, float("inf"), float("inf"))["slowest_ttft"] == {}


def test_wait_until_quiet_waits_out_a_busy_machine():
    # Plain processes, not multiprocessing's (whose resource tracker outlives the test as a child).
    spin = "import time\nend = time.monotonic() + 3\nwhile time.monotonic() < end: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
    try:
        # Every core busy: no window is quiet, so it waits its whole bound.
        assert wait_until_quiet(busy_below=0.5, window_s=0.2, timeout_s=1.0) >= 1.0
    finally:
        for p in spinners:
            p.wait()
    # Any machine is "quiet" below 101 % busy: one window and out.
    assert wait_until_quiet(busy_below=1.01, window_s=0.1, timeout_s=30.0) < 30.0


def test_metric_values_match_summarize():
    records = [_record(0.0, [0.1, 0.2, 0.4], "x"), _record(1.0, [1.5], "y"), _record(2.0, [], "x", error="E")]
    s = summarize(records, 2.0, float("inf"), float("inf"))
    assert sorted(metric_values(records, "ttft")) == pytest.approx([100.0, 500.0])
    assert metric_values(records, "tpot") == pytest.approx([150.0])
    assert metric_values(records, "itl") == pytest.approx([100.0, 200.0])
    assert metric_values(records, "e2e", kind="x") == pytest.approx([400.0])
    assert max(metric_values(records, "e2e")) == pytest.approx(s["e2e_ms"]["max"])
    with pytest.raises(ValueError):
        metric_values(records, "latency")
    assert compare.ratio(2.0, 5.0) == 2.5


class _FakeBackend:
    """Streams max_tokens tokens in chunks of two; refuses prompts starting with token 0."""

    def stream(self, request, meta):
        if request.prompt_token_ids[0] == 0:
            raise RuntimeError("refused")
        for i in range(0, request.max_tokens, 2):
            yield list(range(i, min(i + 2, request.max_tokens)))


def test_run_load_records_every_token_and_failures():
    requests = [BenchRequest([1, 2], 5, "ok"), BenchRequest([0], 3, "bad"), BenchRequest([3], 2, "ok")]
    results, wall = run_load(_FakeBackend(), requests, [0.0, 0.0, 0.01])
    assert [len(r["token_times"]) for r in results] == [5, 0, 2]
    assert results[1]["error"] == "RuntimeError('refused')" and results[0]["error"] is None
    assert [r["kind"] for r in results] == ["ok", "bad", "ok"] and wall > 0
    # One at a time: each request goes after the previous one ended.
    results, _ = run_load(_FakeBackend(), [requests[0], requests[2]], None)
    assert results[1]["sent"] >= results[0]["token_times"][-1]
    with pytest.raises(ValueError):
        run_load(_FakeBackend(), requests, [0.0])


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


def test_grpc_backend_retries_unavailable_only_before_the_first_token():
    from splitserve.cli.loadgen import GrpcBackend
    backend = GrpcBackend("127.0.0.1:1", retry_unavailable_s=30)
    calls = []

    def generate(prompt, **kwargs):  # refused twice, then two tokens, then refused mid-stream
        calls.append(prompt)
        if len(calls) <= 2:
            raise _Unavailable()
        yield types.SimpleNamespace(token_ids=[7], finished=False)
        yield types.SimpleNamespace(token_ids=[8], finished=False)
        if len(calls) == 3:
            raise _Unavailable()

    backend.client = types.SimpleNamespace(generate=generate)
    results, _ = run_load(backend, [BenchRequest([1], 2, "x")], None)
    assert results[0]["retries"] == 2 and results[0]["error"] is not None  # not retried after tokens
    assert len(results[0]["token_times"]) == 2
    s = summarize(results, 1.0, float("inf"), float("inf"))
    assert s["retried_requests"] == 1 and s["retries"] == 2 and s["failed"] == 1


def test_every_comparison_parses():
    parser = compare.build_parser()
    for name in ("disagg", "tpot-target", "batching", "prefix", "overhead", "http", "load"):
        args = parser.parse_args([name, "--quick"])
        assert args.func.__name__ == f"cmd_{name.replace('-', '_')}" and args.quick
    assert parser.parse_args(["load", "--rates", "0.5,2"]).rates == [0.5, 2.0]
    assert parse_rates("1,inf") == [1.0, float("inf")]


def test_overhead_comparison_quick_end_to_end(tiny_model_dirs, tmp_path, children_left):
    """`python -m bench.compare overhead --quick` on the tiny model: a stack and the in-process
    engine, interleaved; every request completes, JSON + PNG written, no process left behind."""
    out = tmp_path / "overhead.json"
    code = compare.main(["overhead", "--quick", "--model", str(tiny_model_dirs["llama"]), "--dtype", "float32",
                         "--num-gpu-blocks", "256", "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    for system in ("stack", "in_process"):
        for phase, n in (("unloaded", 2), ("poisson", 6)):
            s = report["systems"][system][phase]
            assert s["completed"] == n and s["failed"] == 0, (system, phase, s)
    assert report["commands"]["stack"].startswith("splitserve up")
    assert report["machine"]["cpu_count"] and report["commit"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert not children_left()


def test_http_comparison_quick_end_to_end(tiny_model_dirs, tmp_path, children_left):
    """`python -m bench.compare http --quick`: the same requests over gRPC and over the OpenAI HTTP
    API of one stack; every request completes with its full length on both."""
    out = tmp_path / "http.json"
    code = compare.main(["http", "--quick", "--model", str(tiny_model_dirs["llama"]), "--dtype", "float32",
                         "--num-gpu-blocks", "256", "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    for phase, n in (("unloaded", 2), ("poisson", 6)):
        grpc_run, http_run = (report["systems"][arm][phase] for arm in ("grpc", "http"))
        for s in (grpc_run, http_run):
            assert s["completed"] == n and s["failed"] == 0, (phase, s)
        assert grpc_run["output_tokens"] == http_run["output_tokens"] > 0
    assert "poisson_ttft_p50_ms" in report["http_minus_grpc"]
    assert not children_left()
