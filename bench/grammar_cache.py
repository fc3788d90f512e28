"""A worker's memory under a stream of distinct grammars: the compiled-grammar cache bounded
(``--grammar-cache-mb``) against unbounded (what every worker did before), alternated.

    python -m bench.grammar_cache --grammars 150 --bounded-mb 64 --rounds 2 --out bench/results/grammar_cache.json

Each arm is a fresh process with the default model's tokenizer and an engine's ``GrammarCompiler``
that compiles ``--grammars`` distinct regexes (an e-mail-like pattern, its domain list made
distinct per request: 1.7 MB and ~160 ms each on SmolLM2's 49k vocabulary, as a client that sends
a new pattern with every request would make the worker compile); it records the process's
resident memory and the cache's bytes every 25 grammars. No model weights are loaded: the
difference between the arms is the cache.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from bench.common import write_json

ROOT = Path(__file__).resolve().parents[1]

ARM = """
import json, re, sys
from splitserve.engine.grammar import GrammarCompiler
from splitserve.engine.model_files import load_tokenizer, resolve_model
from splitserve.engine.structured_output import StructuredOutput
model, grammars, cache_mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tokenizer = load_tokenizer(resolve_model(model))
compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_bytes=cache_mb << 20)
def rss_mib():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
samples = [{"grammars": 0, "rss_mib": rss_mib(), "cache_mib": 0.0}]
for i in range(grammars):
    compiler.grammar(StructuredOutput(regex=f"[a-zA-Z0-9 ]{{1,40}}@[a-z]{{2,10}}\\\\.(com|org|net|x{i})"))
    if (i + 1) % 25 == 0 or i + 1 == grammars:
        samples.append({"grammars": i + 1, "rss_mib": rss_mib(), "cache_mib": compiler.cached_bytes / 2**20})
print(json.dumps({"samples": samples, "misses": compiler.misses, "entries": len(compiler._cache)}))
"""


def run_arm(model: str, grammars: int, cache_mb: int) -> dict:
    out = subprocess.run([sys.executable, "-c", ARM, model, str(grammars), str(cache_mb)], cwd=ROOT, check=True,
                         capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
                                                              "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--grammars", type=int, default=150)
    parser.add_argument("--bounded-mb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    arms = {"bounded": args.bounded_mb, "unbounded": 1 << 20}
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, cache_mb in arms.items():
            runs[name].append(run_arm(args.model, args.grammars, cache_mb))
            last = runs[name][-1]["samples"][-1]
            print(name, last, flush=True)
    summary = {name: {"final_rss_mib": [r["samples"][-1]["rss_mib"] for r in rs],
                      "growth_mib": [r["samples"][-1]["rss_mib"] - r["samples"][0]["rss_mib"] for r in rs],
                      "final_cache_mib": [r["samples"][-1]["cache_mib"] for r in rs]} for name, rs in runs.items()}
    write_json(args.out, {"benchmark": "grammar_cache", "model": args.model, "grammars": args.grammars,
                          "bounded_mb": args.bounded_mb, "rounds": args.rounds,
                          "method": re.sub(r"\s+", " ", __doc__.split("\n\n")[2]), "runs": runs, "summary": summary})
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
