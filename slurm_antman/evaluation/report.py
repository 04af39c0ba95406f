"""Writing a replay's results: one JSON document (the keys the issue names, per policy) and, when
matplotlib is installed, PNG plots. Plotting is optional so the simulator runs on a bare install."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

from .metrics import jct_by_class

PLOT_HINT = "plots skipped: matplotlib is not installed (pip install matplotlib)"


def document(results: Sequence, meta: Mapping) -> dict:
    return {"meta": dict(meta), "policies": {r.policy: r.metrics for r in results}}


def write(out_dir: str | Path, results: Sequence, meta: Mapping) -> list[str]:
    """Writes results.json, jobs-POLICY.csv and the plots; returns notes for the user."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(document(results, meta), indent=2, sort_keys=True) + "\n")
    for r in results:
        with open(out / f"jobs-{r.policy}.csv", "w") as f:
            cols = list(r.jobs[0]) if r.jobs else []
            f.write(",".join(cols) + "\n")
            for row in r.jobs:
                f.write(",".join("" if row[c] is None else str(row[c]) for c in cols) + "\n")
    return plot(out, results)


def plot(out: Path, results: Sequence) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [PLOT_HINT]
    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for r in results:
        t = [s[0] / 3600 for s in r.series]
        axes[0].plot(t, [s[1] for s in r.series], label=r.policy, lw=0.8)
        axes[1].plot(t, [s[2] for s in r.series], label=r.policy, lw=0.8)
    axes[0].set_ylabel("SM utilisation")
    axes[1].set_ylabel("GPU memory utilisation")
    axes[1].set_xlabel("hours")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "utilisation.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        for cls, xs in sorted(jct_by_class(r.jobs).items()):
            xs = sorted(xs)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{r.policy} {cls}", where="post")
    ax.set_xscale("log")
    ax.set_xlabel("JCT (s)")
    ax.set_ylabel("CDF")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "jct_cdf.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        w = sorted(j["first_start_s"] - j["submit_s"] for j in r.jobs if j["first_start_s"] is not None)
        if w:
            ax.step([max(x, 1.0) for x in w], [(i + 1) / len(w) for i in range(len(w))], label=r.policy, where="post")
    ax.set_xscale("log")
    ax.set_xlabel("queueing delay (s)")
    ax.set_ylabel("CDF")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "queue_delay.png", dpi=120)
    plt.close(fig)
    return []
