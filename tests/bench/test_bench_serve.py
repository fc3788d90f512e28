"""bench/serve.py computes vLLM's metric definitions; checked on hand-made timings."""
import pytest

from splitserve.cli.loadgen import summarize


def test_metric_definitions():
    # Request A: sent at 0, tokens at 0.1, 0.2, 0.4. Request B: sent at 1, one token at 1.5.
    results = [
        {"sent": 0.0, "token_times": [0.1, 0.2, 0.4], "error": None, "prompt_tokens": 3, "max_tokens": 3},
        {"sent": 1.0, "token_times": [1.5], "error": None, "prompt_tokens": 3, "max_tokens": 1},
        {"sent": 2.0, "token_times": [], "error": "UNAVAILABLE", "prompt_tokens": 3, "max_tokens": 2},
    ]
    s = summarize(results, wall=2.0, slo_ttft_ms=200, slo_tpot_ms=200)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["output_tokens"] == 4 and s["output_tokens_per_s"] == 2.0
    assert s["ttft_ms"]["p50"] == pytest.approx(300.0)  # median of 100 and 500
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)  # (0.4 - 0.1) / 2, only A has 2+ tokens
    assert s["itl_ms"]["mean"] == pytest.approx(150.0)  # gaps 100 and 200
    assert s["e2e_ms"]["p99"] == pytest.approx(500.0, rel=0.02)
    # Only A meets TTFT <= 200 ms and TPOT <= 200 ms: goodput 1 request / 2 s.
    assert s["goodput_requests_per_s"] == 0.5
