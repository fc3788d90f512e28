"""`python -m bench.gateway_footprint` end to end: a gateway of the base revision and one of this
tree, in turns, on the tiny model; this tree's never maps torch's library. No timing asserted."""
import json

from bench import gateway_footprint


def test_the_gateway_starts_without_torch(tiny_model_dirs, tmp_path):
    out = tmp_path / "footprint.json"
    assert gateway_footprint.main(["--base", "HEAD", "--rounds", "1", "--model", str(tiny_model_dirs["llama"]),
                                   "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    [tree] = report["runs"]["tree"]
    assert tree["torch_mapped"] is False
    assert tree["start_s"] > 0 and tree["rss_mib"] > 0
    assert len(report["runs"]["base"]) == 1 and report["summary"]["tree"]["rss_mib_median"] == tree["rss_mib"]
