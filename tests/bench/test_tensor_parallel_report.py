"""docs/performance.md and docs/deploy.md report the TP=2 vs TP=1 throughput that
bench/results/tensor_parallel.json measured (both sizes in the same interleaved run), not numbers
of their own: a rerun that changes the JSON and not the docs (or the reverse) fails here."""
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def flat(path: Path) -> str:
    return " ".join(path.read_text().split())  # the docs wrap lines anywhere


def test_docs_report_the_measured_tp2_against_tp1_throughput():
    result = json.loads((ROOT / "bench" / "results" / "tensor_parallel.json").read_text())
    assert result["config"]["systems"] == ["splitserve", "splitserve-tp2"]
    by_name = {w["workload"]["name"]: w for w in result["workloads"]}
    mixed, prefill = by_name["mixed"]["systems"], by_name["prefill"]["systems"]
    out1, out2 = mixed["splitserve"]["output_tokens_per_s"], mixed["splitserve-tp2"]["output_tokens_per_s"]
    in1, in2 = prefill["splitserve"]["prompt_tokens_per_s"], prefill["splitserve-tp2"]["prompt_tokens_per_s"]
    rounds = {len(runs) for w in by_name.values() for runs in w["runs"].values()}
    assert rounds == {result["config"]["pairs"]} == {3}
    assert "--prompt-lens 1024" in " ".join(result["config"]["argv"])
    performance = flat(ROOT / "docs" / "performance.md")
    assert (f"interleaved, 3 rounds: **{out2 / out1:.2f}×** output tokens/s on the mixed workload "
            f"({out2:.1f} vs {out1:.1f}) and {in2 / in1:.2f}× prompt tokens/s on a 1,024-token prompt "
            f"({in2:,.0f} vs {in1:,.0f})") in performance
    deploy = flat(ROOT / "docs" / "deploy.md")
    assert (f"{out2:.0f} vs {out1:.0f} output tokens/s on the mixed workload ({out2 / out1:.2f}x), "
            f"{in2:,.0f} vs {in1:,.0f} prompt tokens/s for 1,024-token prompts ({in2 / in1:.2f}x)") in deploy
