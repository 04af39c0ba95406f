"""Writing a replay's results: one JSON document (the keys docs/evaluation.md reads, per policy) and, when
matplotlib is installed, PNG plots. Plotting is optional so the simulator runs on a bare install."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Collection, Mapping, Sequence

from .metrics import compare, jct_by_class
from .site_page import page

PLOT_HINT = "plots skipped: matplotlib is not installed (pip install matplotlib)"


BASELINES = ("exclusive", "quota", "scavenger", "shared")


def document(results: Sequence, meta: Mapping) -> dict:
    """The metrics per policy, and the ratios of every other policy against ``exclusive``, against
    ``quota`` (whose guaranteed jobs are what the 1.03x target compares with) and against the best
    baseline on mean JCT (the 0.8x / 1.0x targets)."""
    doc = {"meta": dict(meta), "policies": {r.policy: r.metrics for r in results}}
    by = {r.policy: r for r in results}
    for name in ("exclusive", "quota"):
        base = by.get(name)
        if base is not None:
            doc[f"against_{name}"] = {r.policy: compare(base.metrics, base.jobs, r.metrics, r.jobs)
                                      for r in results if r is not base}
    done = [by[b] for b in BASELINES if b in by and by[b].metrics.get("jct_mean_s")]
    if done and "antman" in by:
        best = min(done, key=lambda r: r.metrics["jct_mean_s"])
        doc["best_baseline"] = best.policy
        doc["antman_against_best"] = compare(best.metrics, best.jobs, by["antman"].metrics, by["antman"].jobs)
    return doc


def write_jobs(out_dir: str | Path, result) -> None:
    """jobs-POLICY.csv: one row per job of one run (``write`` calls it for a run not written yet)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"jobs-{result.policy}.csv", "w") as f:
        cols = list(result.jobs[0]) if result.jobs else []
        f.write(",".join(cols) + "\n")
        for row in result.jobs:
            f.write(",".join("" if row[c] is None else str(row[c]) for c in cols) + "\n")


def write(out_dir: str | Path, results: Sequence, meta: Mapping, written: Collection[str] = ()) -> list[str]:
    """Writes results.json, jobs-POLICY.csv (but for the policies in ``written``, whose ``write_jobs``
    ran as their runs ended), the plots and the results page (report.md, site_page); returns notes
    for the user."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = document(results, meta)
    (out / "results.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    for r in results:
        if r.policy not in written:
            write_jobs(out, r)
    notes = plot(out, results, meta.get("perturbed"))
    (out / "report.md").write_text(page(doc, {f.name for f in out.iterdir()}))
    return notes + [f"the results page: {out / 'report.md'}"]


def trade_points(results: Sequence, perturbed: Mapping | None = None) -> list[dict]:
    """Per policy: its guaranteed jobs' run time over their work (x) and its mean JCT (y): the mean and
    range of the ``--perturb`` runs where they were made, else the one run's value (as both ends)."""
    points = []
    for r in results:
        x, y = r.metrics.get("guaranteed_run_stretch_mean"), r.metrics.get("jct_mean_s")
        if not isinstance(x, (int, float)) or not isinstance(y, (int, float)):
            continue
        m = ((perturbed or {}).get(r.policy) or {}).get("metrics", {})
        xs, ys = m.get("guaranteed_run_stretch_mean"), m.get("jct_mean_s")
        x, y = (xs["mean"] if xs else x), (ys["mean"] if ys else y)
        points.append({"policy": r.policy, "x": x, "y": y,
                       "x_range": (xs["min"], xs["max"]) if xs else (x, x),
                       "y_range": (ys["min"], ys["max"]) if ys else (y, y)})
    return points


def trade_plot(points: Sequence[Mapping], path: Path, ranged: bool = False, title: str = "") -> None:
    """What a site weighs first: how fast jobs finish (mean JCT) against what sharing costs the
    guaranteed ones (their run time over their work); one point per policy, its range as bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in points:
        # (at least 0: the mean of equal runs can come out a rounding error beyond them, which
        # matplotlib refuses as a negative error bar)
        xerr = [[max(0.0, p["x"] - p["x_range"][0])], [max(0.0, p["x_range"][1] - p["x"])]]
        yerr = [[max(0.0, p["y"] - p["y_range"][0])], [max(0.0, p["y_range"][1] - p["y"])]]
        ax.errorbar([p["x"]], [p["y"]], xerr=xerr, yerr=yerr, fmt="o", capsize=3)
        ax.annotate(p["policy"], (p["x"], p["y"]), textcoords="offset points", xytext=(6, 4), fontsize=9)
    ax.axvline(1.0, color="grey", lw=0.6, ls="--")
    ys = [p["y"] for p in points]
    if min(ys) > 0 and max(ys) / min(ys) > 5:  # a policy that queues for days would flatten the rest
        ax.set_yscale("log")
    ax.set_xlabel("guaranteed jobs' run time / their work alone (1 = never slowed)")
    ax.set_ylabel("mean JCT (s)" + (", log scale" if ax.get_yscale() == "log" else ""))
    ax.set_title(title or ("faster on the whole, at what cost to guaranteed jobs"
                           + (" (bars: --perturb range)" if ranged else "")), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


CDF_POINTS = 2000  # per curve: a plot a few hundred pixels wide shows no more


def cdf_points(values: Sequence[float], most: int = CDF_POINTS) -> tuple[list[float], list[float]]:
    """The empirical CDF of ``values`` as (x, y) for a step plot: every value of a short list; of a long
    one (the whole Philly trace has 82,000 jobs a policy) ``most`` of them evenly by rank, the smallest
    and the largest among them, so that drawing five policies' curves takes a fraction of a second."""
    xs = sorted(values)
    n = len(xs)
    ranks = range(n) if n <= most else sorted({round(k * (n - 1) / (most - 1)) for k in range(most)})
    return [xs[i] for i in ranks], [(i + 1) / n for i in ranks]


def plot(out: Path, results: Sequence, perturbed: Mapping | None = None) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [PLOT_HINT]
    points = trade_points(results, perturbed)
    if points:
        trade_plot(points, out / "jct_against_guarantee.png", ranged=bool(perturbed))
    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    # Hours from the first submission, to the last submission plus half the window: the tail of
    # long jobs draining afterwards would squeeze the part the utilisation metrics average over.
    t0, t1 = 0.0, 0.0
    for r in results:
        t0, t1 = r.metrics.get("measure_window_s", [0.0, 0.0])
        series = [s for s in r.series if t0 <= s[0] <= t1 + 0.5 * (t1 - t0)]
        t = [(s[0] - t0) / 3600 for s in series]
        axes[0].plot(t, [s[1] for s in series], label=r.policy, lw=0.8)
        axes[1].plot(t, [s[2] for s in series], label=r.policy, lw=0.8)
    for ax in axes:
        ax.axvline((t1 - t0) / 3600, color="grey", lw=0.6, ls="--")
    axes[0].set_ylabel("SM utilisation")
    axes[1].set_ylabel("GPU memory utilisation")
    axes[1].set_xlabel("hours from the first submission (dashed: last submission)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "utilisation.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        for cls, xs in sorted(jct_by_class(r.jobs).items()):
            ax.step(*cdf_points(xs), label=f"{r.policy} {cls}", where="post")
    ax.set_xscale("log")
    ax.set_xlabel("JCT (s)")
    ax.set_ylabel("CDF")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "jct_cdf.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        w = [max(j["first_start_s"] - j["submit_s"], 1.0) for j in r.jobs if j["first_start_s"] is not None]
        if w:
            ax.step(*cdf_points(w), label=r.policy, where="post")
    ax.set_xscale("log")
    ax.set_xlabel("queueing delay (s)")
    ax.set_ylabel("CDF")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "queue_delay.png", dpi=120)
    plt.close(fig)

    # Guaranteed-job slowdown: JCT over the job's solo run time (1 = started at once, ran alone).
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for r in results:
        sl = [(j["end_s"] - j["submit_s"]) / j["duration_s"] for j in r.jobs
              if j["end_s"] is not None and j["class"] == "guaranteed" and j["duration_s"] > 0]
        if sl:
            ax.step(*cdf_points(sl), label=r.policy, where="post")
    ax.set_xscale("log")
    ax.set_xlabel("guaranteed JCT / solo run time")
    ax.set_ylabel("CDF")
    ax.legend()
    names = [r.policy for r in results]
    bx.bar(names, [r.metrics.get("preemptions", 0) for r in results], color="tab:red")
    bx.set_ylabel("preemptions", color="tab:red")
    b2 = bx.twinx()
    b2.plot(names, [r.metrics.get("preemption_lost_gpu_s", 0.0) / 3600 for r in results], "ko")
    b2.set_ylabel("GPU hours lost to preemption")
    fig.tight_layout()
    fig.savefig(out / "guaranteed_slowdown_preemptions.png", dpi=100)
    plt.close(fig)
    return []


TABLE_KEYS = (
    ("jct_mean_s", "JCT mean (s)", "{:,.0f}"), ("jct_guaranteed_mean_s", "guaranteed JCT mean (s)", "{:,.0f}"),
    ("guaranteed_run_stretch_mean", "guaranteed run time / work", "{:.3f}"),
    ("jct_opportunistic_mean_s", "opportunistic JCT mean (s)", "{:,.0f}"),
    ("queue_delay_mean_s", "queueing delay mean (s)", "{:,.0f}"),
    ("sm_util", "SM util", "{:.3f}"), ("useful_util_queued", "useful util while jobs queue", "{:.3f}"),
    ("mem_util", "mem util", "{:.3f}"),
    ("jobs_done", "jobs done", "{}"), ("jobs_done_twice", "jobs done twice", "{}"),
    ("preemptions", "preemptions (moves incl.)", "{}"), ("moves", "moves", "{}"),
    ("preemption_lost_gpu_s", "GPU-h lost to preemption", "{:.1f}"), ("oom_failures", "OOM failures", "{}"),
)
RATIO_KEYS = ("jct_mean_ratio", "jct_guaranteed_mean_ratio", "jct_guaranteed_same_jobs_ratio",
              "useful_util_queued_ratio", "sm_util_ratio", "mem_util_ratio")
ORDER = ("exclusive", "quota", "scavenger", "shared", "antman")


def markdown_table(doc: Mapping) -> str:
    """The per-policy table of docs/evaluation.md from a results document, with antman's ratios
    against exclusive, quota and the best baseline on mean JCT."""
    pols = [p for p in ORDER if p in doc["policies"]]
    lines = ["| metric | " + " | ".join(pols) + " |", "|---|" + "---|" * len(pols)]
    for key, label, fmt in TABLE_KEYS:
        cells = []
        for p in pols:
            v = doc["policies"][p].get(key)
            if key == "preemption_lost_gpu_s" and v is not None:
                v = v / 3600
            cells.append("-" if v is None else fmt.format(v))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    floor = next((doc["policies"][p].get("jct_floor_mean_s") for p in pols), None)
    if floor:
        lines += ["", f"JCT floor (every job alone on its GPUs at submission, what no policy can beat): "
                  f"{floor:,.0f} s; mean JCT over it: "
                  + ", ".join(f"{p} {doc['policies'][p]['jct_mean_s'] / floor:.3f}" for p in pols
                              if doc["policies"][p].get("jct_mean_s") is not None)]
    cols = [(f"against {b}", doc[f"against_{b}"].get("antman")) for b in ("exclusive", "quota")
            if "antman" in doc.get(f"against_{b}", {})]
    if doc.get("antman_against_best"):
        cols.append((f"against the best baseline ({doc['best_baseline']})", doc["antman_against_best"]))
    if cols:
        lines += ["", "| antman | " + " | ".join(c for c, _ in cols) + " |", "|---|" + "---|" * len(cols)]
        for key in RATIO_KEYS:
            lines.append(f"| {key} | " + " | ".join(
                "-" if c.get(key) is None else f"{c[key]:.3f}" for _, c in cols) + " |")
    return "\n".join(lines) + "\n"
