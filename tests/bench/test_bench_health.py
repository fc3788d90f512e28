"""`python -m bench.health_under_load --quick`: more streams than the old servers had threads
(64 per process) open at once on one gateway; every one finishes, and health answers throughout.
(The figures, and the 2,000-stream run, are the benchmark's: no timing is asserted here.)"""
import json

from bench import health_under_load


def test_hundreds_of_concurrent_streams_all_finish_and_health_keeps_answering(tiny_model_dirs, tmp_path, children_left):
    out = tmp_path / "health.json"
    # A worker that runs 2 at a time: the others wait open, in the gateway and in the engine's queue.
    code = health_under_load.main(["--streams", "300", "--max-tokens", "12", "--max-num-seqs", "2", "--quick",
                                   "--model", str(tiny_model_dirs["llama"]), "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["outcomes"] == {"OK": 300} and report["tokens"] == 300 * report["max_tokens"]
    # The gateway and the worker held them together (one thread per stream capped this at 64)...
    assert report["max_requests_in_engines"] > 64
    # ... and got an answer, SERVING, every time it asked while they ran.
    assert report["health_during_load"]["n"] > 0 and report["health_not_serving_during_load"] == 0
    assert report["machine"]["cpu_count"] and report["commit"]
    assert not children_left()
