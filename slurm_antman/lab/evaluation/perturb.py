"""How far a simulated result moves with the coordinator cycle's phase (``antman bench simulate --perturb N``).

One run is one path through a chaotic system: a coordinator cycle a second earlier or later starts a job
on another GPU, and everything after differs. On the Philly window (48 x 8) single runs with ``cycle_s``
28 to 32 s gave antman 7,732-7,847 s of mean JCT and ``shared`` at one slot 8,077-8,304 s; saturated,
12,742-13,291 s and 12,341-12,731 s (2026-11-27; docs/evaluation.md, "How far one run moves"). A gap of
a few percent between two single runs can be this phase alone. So a comparison reports the mean and
range over runs whose cycle is shifted by whole seconds around the nominal one; the workload, the trace
and every policy setting stay the same.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Sequence

# The metrics summarised over the runs (those a comparison in docs/evaluation.md quotes).
KEYS = ("jct_mean_s", "jct_guaranteed_mean_s", "jct_opportunistic_mean_s", "guaranteed_run_stretch_mean",
        "queue_delay_mean_s", "moves", "preemptions", "preemption_lost_gpu_s", "width_changes")


def offsets(n: int) -> list[int]:
    """``n`` whole-second shifts, 0 (the nominal cycle) among them: 5 -> -2..2, 4 -> -1..2."""
    if n < 1:
        raise ValueError(f"--perturb must be at least 1 (runs per policy), got {n}")
    return [k - (n - 1) // 2 for k in range(n)]


def cycles(cycle_s: float, n: int) -> list[float]:
    """The cycle of each run; every one must stay positive."""
    out = [cycle_s + d for d in offsets(n)]
    if min(out) <= 0:
        raise ValueError(f"--perturb {n} shifts --cycle-s {cycle_s:g} by {offsets(n)[0]} s, to {min(out):g} s: "
                         f"the cycle must stay above 0 (use a longer --cycle-s or fewer runs)")
    return out


def summarize(runs: Sequence[dict]) -> dict:
    """For each of ``KEYS`` the runs have (numbers): mean, min, max and the values, in run order."""
    out: dict = {}
    for k in KEYS:
        vals = [r[k] for r in runs if isinstance(r.get(k), (int, float))]
        if len(vals) == len(runs) and vals:
            out[k] = {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals), "runs": vals}
    return out


def variants(cfg, n: int) -> list:
    """The runs of ``cfg`` besides the nominal one, in cycle order: ``cfg`` at each shifted cycle."""
    if n <= 1:
        return []
    return [dataclasses.replace(cfg, cycle_s=c) for c in cycles(cfg.cycle_s, n) if c != cfg.cycle_s]


def collect(cfg, n: int, nominal: dict, others: Sequence[dict]) -> dict:
    """``{"cycle_s": [...], "metrics": summarize(...)}`` from the nominal run's metrics and those of
    ``variants(cfg, n)``'s runs, in that order."""
    each = cycles(cfg.cycle_s, n)
    rest = iter(others)
    per_run = [nominal if c == cfg.cycle_s else next(rest) for c in each]
    return {"cycle_s": each, "metrics": summarize(per_run)}


def run(cfg, n: int, simulate_one: Callable, nominal: dict) -> dict:
    """The policy of ``cfg`` over ``n`` cycles (the nominal run's metrics are ``nominal``, not rerun)."""
    return collect(cfg, n, nominal, [simulate_one(c).metrics for c in variants(cfg, n)])


def line(policy: str, summary: dict) -> str:
    """One text line: the mean JCT and guaranteed run time over work, each with its range."""
    m = summary["metrics"]
    parts = [f"{policy:<11}"]
    for k, fmt in (("jct_mean_s", "{:,.0f}"), ("guaranteed_run_stretch_mean", "{:.4f}")):
        if k in m:
            s = m[k]
            parts.append(f"{k} {fmt.format(s['mean'])} [{fmt.format(s['min'])}, {fmt.format(s['max'])}]")
    return "  ".join(parts)
