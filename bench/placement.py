"""Placement that knows where pages live (issue 18 part 2), measured on two prefill/decode pairs
of which only one shares a host.

Hosts are network namespaces (tests/harness/netns.py), each with its own /dev/shm:

    host A: prefill1 + decode1    (the same-host pair: KV over shm)
    host B: decode0               (from either prefill worker: KV over tcp)
    host C: prefill0              (to either decode worker: KV over tcp)
    host G: Redis + the gateway

The same-host pair is the one listed last on purpose: between equally loaded workers the old
placement keeps the registry's order, so load alone lands on the cross-host pair here (with
the other naming it happens to land on the good one: by luck, not by knowing).

The network between hosts is capped at ``--rate-mbit`` (htb on every prefill->decode path that
crosses hosts), standing in for a link slower than memory. Two runs, each on a fresh stack:

* ``transfer_aware``: the workers register their own host ids (the default), so the gateway
  sees which pairs can use shm;
* ``load_only``: every worker registers the same ``--host-id``, so every pair looks equally
  cheap to the gateway and placement is by load alone, as before this change (the prefill
  worker still finds shm unreachable across hosts and falls back to tcp).

Each run sends ``--sequential`` requests one after another, then ``--bursts`` bursts of
``--burst-size`` concurrent ones, greedy, and records per request the pair chosen, TTFT and
kv_transfer_ms from the gateway's timeline. Needs root (namespaces).

    sudo python -m bench.placement --out bench/results/placement.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

from bench.common import git_commit, machine, write_json
from tests.harness import netns
from tests.harness.prompts import mixed_prompts
from tests.harness.redis_server import RedisServer
from tests.harness.stack import start_stack
from tests.harness.streams import join_all, run_streams

HOST_OF = {"prefill1": "A", "decode1": "A", "decode0": "B", "prefill0": "C", "gateway": "G"}


def _stack(net: netns.Network, model: str, log_dir: Path, same_host_id: bool):
    hosts = net.hosts
    workers = [n for n in HOST_OF if n != "gateway"]
    name_args = {n: ["--host", "0.0.0.0", "--advertise-host", hosts[HOST_OF[n]].address,
                     *(["--host-id", "one-host-for-all"] if same_host_id else [])] for n in workers}
    redis = RedisServer(host=hosts["G"].address, wrap=tuple(hosts["G"].prefix))
    return start_stack(model, log_dir, prefill=2, decode=2, wrap={n: hosts[h].prefix for n, h in HOST_OF.items()},
                       name_args=name_args, gateway_host=hosts["G"].address, redis_server=redis)


def _run(stack, prompts: list[list[int]], burst_size: int, sequential: int, max_tokens: int) -> list[dict]:
    by_id = {stack.argv[n][stack.argv[n].index("--worker-id") + 1]: n for n in stack.roles}
    rows = []
    groups = [[p] for p in prompts[:sequential]]
    rest = prompts[sequential:]
    groups += [rest[i:i + burst_size] for i in range(0, len(rest), burst_size)]
    for g, group in enumerate(groups):
        streams = run_streams(stack, f"place-{g}", group, max_tokens=max_tokens)
        join_all(streams)
        for s in streams:
            if s.code is not None:
                rows.append({"phase": "sequential" if len(group) == 1 else "burst", "error": str(s.code)})
                continue
            t = s.final.timeline
            pair = (by_id.get(t.prefill_worker, t.prefill_worker), by_id.get(t.decode_worker, t.decode_worker))
            rows.append({"phase": "sequential" if len(group) == 1 else "burst", "prefill": pair[0], "decode": pair[1],
                         "same_host": HOST_OF.get(pair[0]) == HOST_OF.get(pair[1]),
                         "first_token_ms": t.first_token_ms, "kv_transfer_ms": t.kv_transfer_ms})
    return rows


def _summary(rows: list[dict]) -> dict:
    out = {}
    for phase in ("sequential", "burst"):
        ok = [r for r in rows if r["phase"] == phase and "error" not in r]
        if not ok:
            continue
        out[phase] = {"requests": len(ok), "errors": sum(1 for r in rows if r["phase"] == phase and "error" in r),
                      "same_host_share": sum(r["same_host"] for r in ok) / len(ok),
                      "pairs": dict(Counter(f"{r['prefill']}->{r['decode']}" for r in ok)),
                      "decode_share": dict(Counter(r["decode"] for r in ok)),
                      "first_token_ms_p50": statistics.median(r["first_token_ms"] for r in ok),
                      "kv_transfer_ms_p50": statistics.median(r["kv_transfer_ms"] for r in ok)}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="model directory (default: a tiny random Llama made here)")
    parser.add_argument("--rate-mbit", type=float, default=20.0, help="cap on cross-host prefill->decode paths")
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--sequential", type=int, default=10)
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--burst-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--out", default="bench/results/placement.json")
    args = parser.parse_args(argv)
    why_not = netns.unavailable()
    if why_not:
        print(f"cannot run: {why_not}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="ss-placement-"))
    model = args.model
    if not model:
        from tests.harness.tiny_models import make_tiny_model
        model = str(make_tiny_model(work / "tiny-llama"))
    n = args.sequential + args.bursts * args.burst_size
    result = {"commit": git_commit(), "machine": machine(), "topology": HOST_OF, "args": vars(args), "runs": {}}
    netns.cleanup_stale()
    for mode in ("transfer_aware", "load_only"):
        with netns.Network.create() as net:
            for h in ("A", "B", "C", "G"):
                net.add_host(h)
            hosts = net.hosts
            for src, dsts in (("A", ["B"]), ("C", ["A", "B"])):
                net.shape(hosts[src], [hosts[d] for d in dsts], rate_mbit=args.rate_mbit)
            with _stack(net, model, work / mode, same_host_id=mode == "load_only") as stack:
                # Fresh prompts per run: neither run profits from the other's prefix caches.
                prompts = mixed_prompts(n, seed=18, lo=args.prompt_tokens, hi=args.prompt_tokens)
                rows = _run(stack, prompts, args.burst_size, args.sequential, args.max_tokens)
        result["runs"][mode] = {"summary": _summary(rows), "requests": rows}
        print(mode, json.dumps(result["runs"][mode]["summary"], indent=1))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
