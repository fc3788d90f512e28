"""``python -m bench.gpu_check --device cpu``: the device check's own code rehearsed here, so a step
broken on the way (a probe reading a changed return value) is found before the GPU machine's
few minutes are spent on it. The steps that start stacks are rehearsed by hand (docs/engine.md)."""
import json

from bench import gpu_check


def test_the_engine_steps_run_and_record_their_figures(tmp_path):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--steps", "roofline,decode_throughput,triton_decode_bandwidth",
                           "--out", str(out)]) == 0
    steps = json.loads(out.read_text())["steps"]
    assert steps["roofline"]["ok"] is True and steps["roofline"]["decode"][0]["step_ms"] > 0
    rows = steps["decode_throughput"]["rows"]
    assert [row["batch"] for row in rows] == [1, 4] and all(row["phases_ms"]["forward"] > 0 for row in rows)
    assert all(row["async_step_ms"] > 0 for row in rows) and steps["decode_throughput"]["async_steps_overlapped"] > 0
    assert steps["triton_decode_bandwidth"] == {"ok": None, "skipped": "compiled Triton needs CUDA"}
