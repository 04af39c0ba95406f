"""Per-policy summary numbers from the per-job rows of a replay (simulated or on the devcluster), so
both report the same keys computed the same way."""

from __future__ import annotations

import statistics
from typing import Iterable, Mapping, Optional


def _mean(xs: list[float]) -> Optional[float]:
    return statistics.fmean(xs) if xs else None


def _pct(xs: list[float], q: float) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(rows: Iterable[Mapping]) -> dict:
    """``jobs_done``, JCT (end - submit) overall and per class, queueing delay (first start - submit),
    preemptions and the GPU time they lost. A job's class is the one it last ran as."""
    rows = list(rows)
    done = [r for r in rows if r.get("end_s") is not None]
    jct = [r["end_s"] - r["submit_s"] for r in done]
    by_class: dict[str, list[float]] = {}
    for r, t in zip(done, jct):
        by_class.setdefault(r["class"], []).append(t)
    waits = [r["first_start_s"] - r["submit_s"] for r in rows if r.get("first_start_s") is not None]
    return {
        "jobs_submitted": len(rows),
        "jobs_done": len(done),
        "jct_mean_s": _mean(jct),
        "jct_p50_s": _pct(jct, 0.5),
        "jct_p95_s": _pct(jct, 0.95),
        "jct_guaranteed_mean_s": _mean(by_class.get("guaranteed", [])),
        "jct_opportunistic_mean_s": _mean(by_class.get("opportunistic", [])),
        "jobs_by_class": {k: len(v) for k, v in sorted(by_class.items())},
        "queue_delay_mean_s": _mean(waits),
        "queue_delay_p95_s": _pct(waits, 0.95),
        "preemptions": sum(int(r.get("preemptions", 0)) for r in rows),
        "preemption_lost_gpu_s": sum(float(r.get("lost_gpu_s", 0.0)) for r in rows),
    }


def jct_by_class(rows: Iterable[Mapping]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in rows:
        if r.get("end_s") is not None:
            out.setdefault(r["class"], []).append(r["end_s"] - r["submit_s"])
    return out
