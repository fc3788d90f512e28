"""bench.roofline rehearsed on the CPU with its tiny shape (the GPU machine runs it on the 8B shape)."""
from pytest import approx

from bench import roofline

# The figures are derived in another order than the test derives them (1000 * (a / b) against
# 1000 * a / b): equal to the last bit or two, which depends on the measured bandwidth.
ROUNDING = 1e-12


def test_the_rehearsal_measures_every_cell_that_fits_and_says_why_the_rest_is_skipped(tmp_path):
    config = roofline.SHAPES["tiny"]
    per_token = roofline.kv_bytes_per_token(config, 4)
    out = tmp_path / "roofline.json"
    # Room for 2 x (64 + 64) tokens of KV, not for 4 x (64 + 64).
    kv_gb = 3 * 128 * per_token / 2**30
    argv = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--mode", "eager", "--batches", "1,4",
            "--contexts", "16,64", "--prefill", "16,48", "--steps", "2", "--prefill-iters", "1", "--copy-mib", "4",
            "--matmul-n", "64", "--kv-gb-cpu", str(kv_gb), "--out", str(out)]
    assert roofline.main(argv) == 0
    import json
    result = json.loads(out.read_text())
    assert result["copy_bytes_per_s"] > 0 and result["matmul_flops"] > 0
    cells = {(row["batch"], row["context"]): row for row in result["decode"]}
    assert set(cells) == {(1, 16), (4, 16), (1, 64), (4, 64)}
    assert "not fit" in cells[(4, 64)]["skipped"]
    for key in ((1, 16), (4, 16), (1, 64)):
        row = cells[key]
        assert row["kv_bytes"] == key[0] * key[1] * per_token
        assert row["roofline_ms"] == approx(1000 * (row["weight_bytes"] + row["kv_bytes"]) / result["copy_bytes_per_s"],
                                            rel=ROUNDING)
        assert 0 < row["fraction_of_roofline"] == approx(row["roofline_ms"] / row["step_ms"], rel=ROUNDING)
    assert [row["tokens"] for row in result["prefill"]] == [16, 48]
    head = config["hidden_size"] * config["vocab_size"]
    for row in result["prefill"]:
        assert row["roofline_s"] == approx(2 * (result["layer_parameters"] * row["tokens"] + head) / result["matmul_flops"],
                                           rel=ROUNDING)
        assert row["fraction_of_roofline"] > 0


def test_the_8b_shape_counts_the_parameters_of_llama_3_1_8b():
    config = roofline.SHAPES["llama-3.1-8b"]
    total = roofline.layer_parameters(config) + roofline.head_parameters(config)
    embeddings = config["vocab_size"] * config["hidden_size"]
    # 8.03 B parameters in all (norms are 0.27 M of them).
    assert abs(total + embeddings - 8.030e9) < 0.001e9
    assert roofline.kv_bytes_per_token(config, 2) == 128 * 1024  # 128 KiB of bf16 KV per token
