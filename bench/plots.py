"""Plots of the serving benchmarks (PNG beside each JSON)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.metrics import AIM, metric_values


def plot_cdfs(panels: list[tuple[str, dict[str, list[float]]]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (label, series) in zip(axes[0], panels):
        for name, values in series.items():
            v = np.sort(values)
            if len(v):
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=f"{name} (n={len(v)})")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel(f"{label} (ms, log)")
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def plot_sweep(points: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for (name, series), color in zip(points.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        rates = [p["rate"] for p in series]
        for ax, metric in zip(axes[:2], ("ttft_ms", "tpot_ms")):
            for q, style in (("p50", "-o"), ("p99", "--^")):
                ax.plot(rates, [p["summary"][metric][q] for p in series], style, color=color, label=f"{name} {q}")
        axes[2].plot(rates, [p["summary"]["output_tokens_per_s"] for p in series], "-o", color=color, label=name)
    axes[0].axhline(AIM["ttft_p99_ms"], color="grey", lw=0.8, ls=":", label="aim p99 (100 ms)")
    axes[1].axhline(AIM["tpot_p50_ms"], color="grey", lw=0.8, ls=":", label="aim p50 (32 ms)")
    for ax, label in zip(axes, ("TTFT (ms)", "TPOT (ms)", "output tokens/s")):
        ax.set_xlabel("Poisson arrival rate (requests/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def plot_serve_cdfs(results: list[dict], summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, metric in zip(axes, ("ttft", "itl", "e2e")):
        values = np.sort(metric_values(results, metric))
        ax.plot(values, np.arange(1, len(values) + 1) / max(1, len(values)))
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    fig.suptitle(f"splitserve serving CDFs — {summary['completed']} requests, "
                 f"{summary['output_tokens_per_s']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
