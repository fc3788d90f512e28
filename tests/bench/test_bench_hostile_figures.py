"""`python -m bench.hostile_figures --quick --only B --b .` end to end on the tiny model: one stack of
this working tree (no git worktree: its kernels are built already), the deep schemas refused with INVALID_ARGUMENT naming --max-schema-depth, both large
bodies refused with 413, health polled throughout. (The A/B figures are the benchmark's: no timing
is asserted here.)"""
import json

from bench import hostile_figures


def test_deep_schemas_and_a_large_body_against_this_revision(tiny_model_dirs, tmp_path, children_left):
    out = tmp_path / "hostile.json"
    assert hostile_figures.main(["--quick", "--only", "B", "--b", ".", "--body-mb", "20", "--model",
                                 str(tiny_model_dirs["llama"]), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"B"} and report["revisions"]["B"]
    [run] = report["runs"]["B"]
    stall = run["stall"]
    assert stall["warmup"]["code"] == "OK"
    assert [r["code"] for r in stall["requests"]] == ["INVALID_ARGUMENT"] * 2
    assert all("--max-schema-depth" in r["details"] for r in stall["requests"])
    assert stall["health_during_ms"]["n"] > 0 and stall["health_during_ms"]["statuses"] == ["SERVING"]
    assert [(b["chunked"], b["status"]) for b in run["http_body"]] == [(False, 413), (True, 413)]
    assert report["machine"]["cpu_count"] and report["commit"]
    assert not children_left()
