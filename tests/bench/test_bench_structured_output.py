"""bench/structured_output.py runs on the tiny model and writes every figure (no timing asserted)."""
import json

from bench import structured_output


def test_structured_output_bench_writes_its_figures(tiny_model_dirs, tmp_path):
    out = tmp_path / "so.json"
    structured_output.main(["--model", str(tiny_model_dirs["llama"]), "--skip-engine", "--reps", "1",
                            "--batch", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    xgr = result["mask_per_token"]["xgrammar"]
    assert xgr["tokens"] == len(json.dumps(structured_output.SAMPLE))  # one byte per token
    assert xgr["fill_us"] > 0 and xgr["apply_us"] > 0
    assert result["sampler"]["batch"] == 2 and result["sampler"]["with_grammar_ms"] > 0
