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
    preemptions and the GPU time they lost. ``jct_guaranteed_mean_s`` is over the jobs admitted as
    guaranteed (``submitted_as``, else ``class``): the ones the system promised not to harm; an
    opportunistic job upgraded later counts under ``jct_ran_guaranteed_mean_s`` (the class it last
    ran as), with its opportunistic time in its JCT."""
    rows = list(rows)
    done = [r for r in rows if r.get("end_s") is not None]
    jct = [r["end_s"] - r["submit_s"] for r in done]
    by_class: dict[str, list[float]] = {}
    admitted: dict[str, list[float]] = {}
    for r, t in zip(done, jct):
        by_class.setdefault(r["class"], []).append(t)
        admitted.setdefault(_admitted(r), []).append(t)
    waits = [r["first_start_s"] - r["submit_s"] for r in rows if r.get("first_start_s") is not None]
    # How much longer an admitted-guaranteed job ran than its work: what sharing did to it once it
    # had its GPUs (1.0: untouched), apart from the queue it waited in.
    stretch = [(r["end_s"] - r["first_start_s"]) / r["duration_s"] for r in done
               if _admitted(r) == "guaranteed" and r.get("first_start_s") is not None and r.get("duration_s")]
    return {
        "jobs_submitted": len(rows),
        "jobs_done": len(done),
        "jct_mean_s": _mean(jct),
        # No policy can beat it: every job alone on its GPUs the moment it is submitted.
        "jct_floor_mean_s": _mean([r["duration_s"] for r in done if r.get("duration_s") is not None]),
        "jct_p50_s": _pct(jct, 0.5),
        "jct_p95_s": _pct(jct, 0.95),
        "jct_guaranteed_mean_s": _mean(admitted.get("guaranteed", [])),
        "jct_opportunistic_mean_s": _mean(admitted.get("opportunistic", [])),
        "jct_ran_guaranteed_mean_s": _mean(by_class.get("guaranteed", [])),
        "guaranteed_run_stretch_mean": _mean(stretch),
        "jobs_by_class": {k: len(v) for k, v in sorted(by_class.items())},
        "jobs_by_admitted_class": {k: len(v) for k, v in sorted(admitted.items())},
        "queue_delay_mean_s": _mean(waits),
        "queue_delay_p95_s": _pct(waits, 0.95),
        "preemptions": sum(int(r.get("preemptions", 0)) for r in rows),
        "preemption_lost_gpu_s": sum(float(r.get("lost_gpu_s", 0.0)) for r in rows),
    }


def _admitted(r: Mapping) -> str:
    return r.get("submitted_as") or r["class"]


def jct_by_class(rows: Iterable[Mapping]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in rows:
        if r.get("end_s") is not None:
            out.setdefault(r["class"], []).append(r["end_s"] - r["submit_s"])
    return out


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def compare(base: Mapping, base_rows: Iterable[Mapping], other: Mapping, other_rows: Iterable[Mapping]) -> dict:
    """``other`` against ``base`` (exclusive) on the same trace: the four ratios of the targets. The
    guaranteed ratio is also given over the same jobs (those admitted guaranteed under ``other``,
    with their JCT under ``base``), since the two policies class different jobs guaranteed."""
    base_jct = {r["job_id"]: r["end_s"] - r["submit_s"] for r in base_rows if r.get("end_s") is not None}
    mine = [(r["end_s"] - r["submit_s"], base_jct[r["job_id"]]) for r in other_rows
            if r.get("end_s") is not None and _admitted(r) == "guaranteed" and r["job_id"] in base_jct]
    return {
        "sm_util_ratio": _ratio(other.get("sm_util"), base.get("sm_util")),
        "useful_util_queued_ratio": _ratio(other.get("useful_util_queued"), base.get("useful_util_queued")),
        "mem_util_ratio": _ratio(other.get("mem_util"), base.get("mem_util")),
        "jct_mean_ratio": _ratio(other.get("jct_mean_s"), base.get("jct_mean_s")),
        "jct_guaranteed_mean_ratio": _ratio(other.get("jct_guaranteed_mean_s"), base.get("jct_guaranteed_mean_s")),
        "jct_guaranteed_same_jobs_ratio": _ratio(_mean([a for a, _ in mine]), _mean([b for _, b in mine])),
        "guaranteed_jobs_compared": len(mine),
    }
