"""bench/engine_throughput.py and bench/step_time.py end to end on the tiny model (vLLM is not
installed in the test environment; its peer runs only where --peer-python names one). No timing
asserted: the JSON must describe every system, workload and round it ran."""
import json

from bench import engine_throughput, step_time
from splitserve.cli.workloads import fresh_tokens, shared_prefix


def test_engine_throughput_runs_every_system_and_workload(tiny_model_dirs, tmp_path):
    # Every system on one workload, every workload on one system: a system runs a workload's
    # requests whatever they are (the full grid took twice as long and checked nothing more).
    common = ["--model", str(tiny_model_dirs["llama"]), "--dtype", "float32", "--prompt-lens", "32,64",
              "--num-requests", "4", "--pairs", "1", "--max-model-len", "1024", "--settle-s", "0",
              "--quiet-timeout-s", "0", "--static-eager"]  # its compiled step is the splitserve system's: one compile fewer
    systems = {"splitserve", "splitserve-eager", "splitserve-torch-linear", "splitserve-inner-product", "static", "hf"}
    engine_throughput.main(["--out", str(tmp_path / "systems.json"), "--workload", "mixed",
                            "--systems", ",".join(sorted(systems)), *common])
    engine_throughput.main(["--out", str(tmp_path / "workloads.json"), "--workload", "mixed,shared,prefill",
                            "--systems", "splitserve", *common])
    by_systems = json.loads((tmp_path / "systems.json").read_text())
    by_workloads = json.loads((tmp_path / "workloads.json").read_text())
    assert [w["workload"]["name"] for w in by_workloads["workloads"]] == ["mixed", "shared", "prefill", "prefill"]
    assert [w["workload"].get("prompt_len") for w in by_workloads["workloads"]][2:] == [32, 64]
    for report, wanted in ((by_systems, systems), (by_workloads, {"splitserve"})):
        for w in report["workloads"]:
            assert set(w["systems"]) == wanted
            for runs in w["runs"].values():
                assert len(runs) == 1 and runs[0]["output_tokens"] == w["workload"]["output_tokens"]
    assert by_systems["config"]["compile_s"]["splitserve"] > 0 == by_systems["config"]["compile_s"]["splitserve-eager"]


def test_shared_workload_shares_one_prefix():
    requests = shared_prefix(6, 1000, seed=3, prefix_len=(512, 512), suffix_len=(16, 64), outputs="mixed")
    prefix = requests[0].prompt_token_ids[:512]
    assert all(r.prompt_token_ids[:512] == prefix and 16 <= len(r.prompt_token_ids) - 512 <= 64 for r in requests)
    assert len({r.prompt_token_ids[512] for r in requests}) > 1
    again = fresh_tokens(requests, 1000, seed=4, shared_prefix_len=512)
    assert [(len(a.prompt_token_ids), a.max_tokens) for a in again] == [
        (len(r.prompt_token_ids), r.max_tokens) for r in requests]
    assert all(a.prompt_token_ids[:512] == again[0].prompt_token_ids[:512] != prefix for a in again)


def test_step_time_table(tiny_model_dirs, tmp_path):
    out = tmp_path / "steps.json"
    step_time.main(["--out", str(out), "--model", str(tiny_model_dirs["llama"]), "--dtype", "float32",
                    "--batches", "1,4", "--contexts", "20,90", "--steps", "2", "--modes", "compiled,eager+async",
                    "--temperature", "1.0"])
    cells = json.loads(out.read_text())["cells"]
    assert [(c["batch"], c["context"]) for c in cells] == [(1, 20), (4, 20), (1, 90), (4, 90)]
    assert all(c["compiled_ms"] > 0 and c["eager+async_ms"] > 0 for c in cells)
    for c in cells:  # host work is every timed phase but the forward, and the sampling ran
        phases = c["compiled_phase_ms"]
        assert phases["sample"] > 0 and phases["forward"] > 0
        assert c["compiled_host_ms"] == sum(ms for phase, ms in phases.items() if phase != "forward")


def test_step_time_interleaves_the_linear_backends(tiny_model_dirs, tmp_path):
    """``@<linear backend>`` modes: one engine each, every cell measured for each, round after round."""
    out = tmp_path / "linears.json"
    step_time.main(["--out", str(out), "--model", str(tiny_model_dirs["llama"]), "--dtype", "float32",
                    "--batches", "2", "--contexts", "20", "--steps", "2", "--rounds", "2",
                    "--modes", "eager@onednn,eager@onednn-matmul"])
    result = json.loads(out.read_text())
    assert result["config"]["linear_backends"] == {"eager@onednn": "onednn", "eager@onednn-matmul": "onednn-matmul"}
    assert [(c["round"], c["batch"]) for c in result["cells"]] == [(0, 2), (1, 2)]
    assert all(c["eager@onednn_ms"] > 0 and c["eager@onednn-matmul_ms"] > 0 for c in result["cells"])
