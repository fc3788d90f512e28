"""`python -m bench.grammar_cache` end to end on a few grammars: both arms run, the bounded one
keeps its cache under its bound while the unbounded one keeps every grammar. No timing asserted."""
import json

from bench import grammar_cache


def test_bounded_and_unbounded_arms(tmp_path):
    out = tmp_path / "grammar_cache.json"
    assert grammar_cache.main(["--grammars", "4", "--bounded-mb", "2", "--rounds", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    [bounded], [unbounded] = report["runs"]["bounded"], report["runs"]["unbounded"]
    assert bounded["misses"] == unbounded["misses"] == 4
    assert bounded["samples"][-1]["cache_mib"] <= 2 and bounded["entries"] < 4
    assert unbounded["entries"] == 4 and unbounded["samples"][-1]["cache_mib"] > 2
