"""Mean JCT by job size, per policy, from the per-job CSVs of ``antman bench simulate --out DIR``
(the multi-GPU jobs' targets are per size bucket; docs/evaluation.md, "Per size bucket"):

    python -m slurm_antman.lab.evaluation.size_buckets DIR

For each bucket (1, 2-4, 5-8 and more than 8 GPUs): the jobs' mean JCT under every policy in DIR;
then, for the jobs antman ran as opportunistic, their total JCT under antman over the same jobs'
under ``exclusive`` (the target: "at most 1.0x per size bucket"), how many there were, and how
often they were preempted (requeues and moves) under antman. Then, from DIR's results.json, antman's
whole-job requeues of multi-GPU jobs by cause beside its width changes (the target: "whole-job requeues
mostly replaced by width changes"; the causes are simulator/antman.py's ``_whole_requeue_cause``).
"""

from __future__ import annotations

import csv
import json
import os
import sys
from typing import Optional, Sequence

BUCKETS = ((1, 1, "1"), (2, 4, "2-4"), (5, 8, "5-8"), (9, 1 << 30, ">8"))
POLICY_ORDER = ("exclusive", "quota", "scavenger", "shared", "antman")


def load(directory: str) -> dict[str, dict[str, dict[str, str]]]:
    """policy -> job id -> its CSV row, for every jobs-POLICY.csv in ``directory``."""
    out = {}
    for p in POLICY_ORDER:
        path = os.path.join(directory, f"jobs-{p}.csv")
        if os.path.exists(path):
            with open(path, newline="") as f:
                out[p] = {r["job_id"]: r for r in csv.DictReader(f)}
    return out


def _jct(row: dict[str, str]) -> float:
    return float(row["end_s"]) - float(row["submit_s"])


def buckets(data: dict[str, dict[str, dict[str, str]]]) -> list[dict]:
    if not data:
        return []
    first = next(iter(data.values()))
    rows = []
    for lo, hi, name in BUCKETS:
        ids = [i for i, r in first.items() if lo <= int(r["gpus"]) <= hi]
        row: dict = {"bucket": name, "jobs": len(ids),
                     "mean_jct_s": {p: (sum(_jct(d[i]) for i in ids) / len(ids) if ids else None)
                                    for p, d in data.items()}}
        if "antman" in data and "exclusive" in data:
            opp = [i for i in ids if data["antman"][i]["class"] == "opportunistic"]
            excl = sum(_jct(data["exclusive"][i]) for i in opp)
            row["opportunistic_jobs"] = len(opp)
            row["opportunistic_vs_exclusive"] = (sum(_jct(data["antman"][i]) for i in opp) / excl) if excl else None
            row["opportunistic_preemptions"] = sum(int(data["antman"][i]["preemptions"]) for i in opp)
        rows.append(row)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or not os.path.isdir(args[0]):
        print("usage: python -m slurm_antman.lab.evaluation.size_buckets DIR (an `antman bench simulate --out` "
              "directory with jobs-POLICY.csv files)", file=sys.stderr)
        return 2
    data = load(args[0])
    if not data:
        print(f"size_buckets: no jobs-POLICY.csv in {args[0]}", file=sys.stderr)
        return 2
    pols = list(data)
    print("bucket   jobs " + " ".join(f"{p:>10}" for p in pols) + "   antman opp / exclusive   opp jobs   preempted")
    for r in buckets(data):
        means = " ".join(f"{r['mean_jct_s'][p]:10.0f}" if r["mean_jct_s"][p] is not None else f"{'-':>10}"
                         for p in pols)
        ratio = r.get("opportunistic_vs_exclusive")
        print(f"{r['bucket']:6} {r['jobs']:6} {means}   {ratio if ratio is None else round(ratio, 3)!s:>22}"
              f"   {r.get('opportunistic_jobs', '-')!s:>8}   {r.get('opportunistic_preemptions', '-')!s:>9}")
    line = requeue_line(args[0])
    if line:
        print(line)
    return 0


def requeue_line(directory: str) -> str:
    """antman's whole-job requeues of multi-GPU jobs by cause, and its width changes; "" without them."""
    path = os.path.join(directory, "results.json")
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        m = json.load(f).get("policies", {}).get("antman", {})
    causes = m.get("multi_gpu_whole_requeues")
    if causes is None:
        return ""
    parts = ", ".join(f"{k} {v}" for k, v in sorted(causes.items(), key=lambda kv: -kv[1])) or "none"
    return (f"antman: whole-job requeues of multi-GPU jobs {sum(causes.values())} ({parts}); "
            f"width changes {m.get('width_changes', 0)}")


if __name__ == "__main__":
    sys.exit(main())
