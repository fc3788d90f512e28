"""`splitserve tune`: the rate search, and a two-point sweep on a tiny model whose config file a
stack then starts from."""
import json
import subprocess
import sys

import pytest

from splitserve.cli.tune import Split, highest_rate, max_probes
from splitserve.client import Client


def fake_stack(capacity: float):
    """A probe of a system that meets the SLO up to ``capacity`` req/s (a fake: the search alone)."""
    def probe(rate):
        ok = rate <= capacity
        return {"failed": 0, "ttft_ms": {"p99": 50 if ok else 500}, "tpot_ms": {"p50": 10}}
    return probe


SLO = {"ttft_p99_ms": 100, "tpot_p50_ms": 20}


@pytest.mark.parametrize("capacity, best, rates", [
    (5.0, 4 * 2 ** 0.25, [1, 2, 4, 8, 4 * 2 ** 0.5, 4 * 2 ** 0.25]),  # double, then bisect twice
    (100.0, 16, [1, 2, 4, 8, 16]),  # the cap
    (0.3, 0.25 * 2 ** 0.25, [1, 0.5, 0.25, 0.25 * 2 ** 0.5, 0.25 * 2 ** 0.25]),  # halve, then bisect
    (0.01, 0.0, [1, 0.5, 0.25, 0.125, 0.0625]),  # nothing passes
])
def test_rate_search_doubles_then_bisects(capacity, best, rates):
    found, probes = highest_rate(fake_stack(capacity), SLO, start_rate=1, max_rate=16, steps=2)
    assert found == pytest.approx(best) and [p["rate"] for p in probes] == pytest.approx(rates)
    assert len(probes) <= max_probes(1, 16, 2)
    assert all(p["meets"] == (p["rate"] <= capacity) for p in probes)


def test_splits_parse_and_print():
    assert str(Split.parse("colocated")) == "colocated" and Split.parse("1:2") == Split(1, 2)
    assert Split.parse("1:1@1:3") == Split(1, 1, 1, 3) and str(Split(1, 1, 1, 3)) == "1:1@1:3"
    for bad in ("0:1", "1", "a:b", "1:1@2"):
        with pytest.raises(ValueError):
            Split.parse(bad)


def tune(*argv, timeout=900):
    return subprocess.run([sys.executable, "-m", "splitserve.cli", "tune", *argv], capture_output=True, text=True,
                          timeout=timeout)


def test_two_point_sweep_writes_a_config_that_up_starts_from(tiny_model_dirs, tmp_path):
    model = str(tiny_model_dirs["llama"])
    common = ["--model", model, "--dtype", "float32", "--num-requests", "4", "--up-args", "--kv-cache-memory-gb 0.05"]
    out = tune(*common, "--slo-ttft-p99-ms", "60000", "--slo-tpot-p50-ms", "60000", "--max-num-seqs", "4",
               "--max-num-batched-tokens", "256", "--splits", "colocated,1:1", "--start-rate", "4", "--max-rate", "8",
               "--search-steps", "1", "--out", str(tmp_path / "sweep"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "sweep" / "tune.json").read_text())
    assert [p["point"]["split"] for p in report["points"]] == ["colocated", "1:1"]
    for point in report["points"]:  # an SLO nobody misses: each search runs up to the cap
        assert [p["rate"] for p in point["probes"]] == [4, 8] and all(p["meets"] for p in point["probes"])
        assert point["goodput_requests_per_s"] == 8 and point["probes"][-1]["summary"]["completed"] == 4
    assert report["best"]["point"]["split"] == "colocated"  # a tie goes to the first point
    assert (tmp_path / "sweep" / "tune.png").stat().st_size > 0 and "tune" in out.stderr  # the progress bar
    config = tmp_path / "sweep" / "tuned.yaml"
    assert "max-num-seqs: 4" in config.read_text() and "prefill: 0" in config.read_text()

    from splitserve.cli.launcher import UpProcess, running
    stack = UpProcess("from-config", ["--config", str(config), "--kv-cache-memory-gb", "0.05"])
    with running([stack]):
        with Client(stack.address) as client:
            roles = [w.role for w in client.server_info().workers if w.role != "gateway"]
            assert roles == ["both"]  # the file's colocated split
        # Pointed at a running stack, with an SLO no request can meet: goodput 0, no config file.
        out = tune(*common, "--address", stack.address, "--slo-ttft-p99-ms", "0.001", "--slo-tpot-p50-ms", "60000",
                   "--start-rate", "64", "--search-steps", "0", "--out", str(tmp_path / "running"))
    assert out.returncode == 1 and "no point met the SLO" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "running" / "tune.json").read_text())
    assert [p["rate"] for p in report["points"][0]["probes"]] == [64, 32, 16, 8, 4]  # halved four times, never met
    assert not any(p["meets"] for p in report["points"][0]["probes"])
    assert not (tmp_path / "running" / "tuned.yaml").exists()
