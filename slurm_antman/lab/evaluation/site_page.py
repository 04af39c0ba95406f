"""The results page of a replay: ``antman bench simulate --out DIR`` writes ``DIR/report.md``, what a
site's admin reads first (docs/admin.md, "What would antman buy my cluster?"). It answers the question in
its first lines, antman's mean job completion time against the best of the Slurm policies replayed and
what it costs the jobs that run with a guarantee, then gives the table behind it, the pictures, what the
replay could not know about the site's jobs, and the command that made it.

Pure: from the results document (``report.document``) and the names of the files written beside it."""

from __future__ import annotations

from typing import Collection, Mapping, Optional

from .simulator.config import POLICIES as ORDER

BASELINES = tuple(p for p in ORDER if p != "antman")

# One line per policy: the Slurm set-up each stands for (docs/evaluation.md, "The baselines").
POLICY_LINES = {
    "exclusive": "whole GPUs, first come first served with EASY backfill: plain Slurm",
    "quota": "whole GPUs, each account held to its quota of GPUs (GrpTRES)",
    "scavenger": "whole GPUs; jobs over their account's quota run in a preemptible partition and are requeued "
                 "when a job within quota needs the GPU (preempt/partition_prio, PreemptMode=REQUEUE)",
    "shared": "GPUs shared through gres/shard with no control: a job that does not fit beside the others fails "
              "out of memory and its user resubmits it",
    "antman": "slurm-antman: jobs within quota guaranteed, the rest opportunistic beside them, held to the "
              "guaranteed jobs' idle memory and compute, paused or requeued when a guaranteed job needs its GPU",
}

# (metric, column, scale, format): the table's columns, hours where the metric is in seconds.
COLUMNS = (
    ("jct_mean_s", "mean JCT (h)", 1 / 3600, "{:,.2f}"),
    ("jct_guaranteed_mean_s", "guaranteed jobs' mean JCT (h)", 1 / 3600, "{:,.2f}"),
    ("guaranteed_run_stretch_mean", "guaranteed run time / work", 1.0, "{:.3f}"),
    ("queue_delay_mean_s", "mean wait (h)", 1 / 3600, "{:,.2f}"),
    ("useful_util_queued", "useful GPU use", 1.0, "{:.2f}"),
    ("preemptions", "requeues", 1.0, "{:,.0f}"),
    ("pauses", "pauses", 1.0, "{:,.0f}"),
    ("oom_failures", "OOM failures", 1.0, "{:,.0f}"),
    ("jobs_done", "jobs done", 1.0, "{:,.0f}"),
)

PICTURES = (
    ("jct_against_guarantee.png", "Mean JCT against the guaranteed jobs' run time over their work, per policy "
                                  "(lower left is better)"),
    ("utilisation.png", "GPU use over time"),
    ("jct_cdf.png", "Job completion times"),
)


def _value(doc: Mapping, policy: str, key: str) -> tuple[Optional[float], Optional[tuple[float, float]]]:
    """The metric's mean over the ``--perturb`` runs (and their range) where they were made, else the
    one run's value."""
    spread = (((doc["meta"].get("perturbed") or {}).get(policy) or {}).get("metrics") or {}).get(key)
    if isinstance(spread, Mapping) and spread.get("mean") is not None:
        return float(spread["mean"]), (float(spread["min"]), float(spread["max"]))
    v = doc["policies"][policy].get(key)
    return (float(v), None) if isinstance(v, (int, float)) and not isinstance(v, bool) else (None, None)


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} h"


def answer(doc: Mapping) -> list[str]:
    """The page's first lines: antman against the best baseline replayed, and its guaranteed jobs."""
    pols = doc["policies"]
    base = {p: _value(doc, p, "jct_mean_s")[0] for p in BASELINES if p in pols}
    base = {p: v for p, v in base.items() if v}
    if "antman" not in pols or not base:
        return ["Replay antman and at least one Slurm policy (`--policy all`) for the comparison; the table "
                "below has what was replayed."]
    best = min(base, key=base.get)
    mine = _value(doc, "antman", "jct_mean_s")[0]
    floor = pols["antman"].get("jct_floor_mean_s")
    if not mine:
        return ["antman's replay finished no job: see the table."]
    ratio = mine / base[best]
    lines = [f"**antman's mean job completion time is {ratio:.3f}x that of the best Slurm policy replayed** "
             f"(`{best}`: {_hours(mine)} against {_hours(base[best])}; "
             + ("shorter" if ratio < 1 else "longer" if ratio > 1 else "the same") + ")."]
    if floor and base[best] > floor:
        way = (base[best] - mine) / (base[best] - floor)
        lines.append(f"No policy can beat {_hours(floor)}, every job alone on its GPUs the moment it was "
                     f"submitted: antman goes {way:.0%} of the way from `{best}` to it"
                     + (" (a negative share: worse than it)." if way < 0 else "."))
    mine_g = _value(doc, "antman", "guaranteed_run_stretch_mean")[0]
    stretch = {p: _value(doc, p, "guaranteed_run_stretch_mean")[0] for p in base}
    if mine_g:
        others = ", ".join(f"`{p}` {v:.3f}x" for p, v in stretch.items() if v)
        lines.append(f"**Its guaranteed jobs run {mine_g:.3f}x their time alone** (what sharing costs the owners "
                     f"of quota once their jobs run); under the Slurm policies: {others}.")
    return lines


def table(doc: Mapping) -> list[str]:
    pols = [p for p in ORDER if p in doc["policies"]]
    out = ["| policy | " + " | ".join(c for _, c, _, _ in COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
    for p in pols:
        cells = []
        for key, _, scale, fmt in COLUMNS:
            v, rng = _value(doc, p, key)
            if v is None:
                cells.append("-")
                continue
            cell = fmt.format(v * scale)
            ends = rng and (fmt.format(rng[0] * scale), fmt.format(rng[1] * scale))
            if ends and ends[0] != ends[1]:  # (a range shown only where the runs differ at this precision)
                cell += f" [{ends[0]}, {ends[1]}]"
            cells.append(cell)
        out.append(f"| `{p}` | " + " | ".join(cells) + " |")
    return out


def caveats(meta: Mapping) -> list[str]:
    """What the replay could not know or took from elsewhere, each in one line."""
    out = [f"- **How busy each job kept its GPUs, and its memory**: the history holds neither; each job's comes "
           f"from the workload model (docs/workload_model.md: `--utilisation {meta.get('utilisation')}`, "
           f"`--util-scale {meta.get('util_scale')}`). Read the answer as what antman's policy does with jobs "
           "like these, not as a measurement of them."]
    skipped = meta.get("sacct_skipped")
    if isinstance(skipped, Mapping):
        out.append("- **Jobs left out of the history**: " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in
                                                                     sorted(skipped.items())) + ".")
    shape = meta.get("shape_from_slurm")
    out.append(f"- **The cluster**: {meta.get('nodes')} nodes of {meta.get('gpus_per_node')} GPUs of "
               f"{meta.get('gpu_mem_gib')} GiB, " + ("as `scontrol show nodes` shows it." if shape else
                                                   "as given by `--nodes` and `--gpus`."))
    quotas = meta.get("quotas_from_slurm")
    out.append("- **Quotas**: " + (f"each account's `GrpTRES=gres/gpu=N` ({len(quotas)} accounts)."
                                   if quotas else f"each account's share of the history's GPU-time times the "
                                                  f"cluster size times `--quota-scale {meta.get('quota_scale')}`."))
    if meta.get("perturbed"):
        cycles = meta.get("perturb_cycles_s") or []
        out.append(f"- **Spread**: each policy ran {len(cycles)} times, with the coordinator's cycle (and the "
                   f"quota file's rewrites) at {', '.join(f'{c:g}' for c in cycles)} s; numbers are their mean, "
                   "brackets their range where the runs differ.")
    else:
        out.append("- **Spread**: one run per policy; one run moves by a few percent with the coordinator "
                   "cycle's phase (`--perturb 5` gives the range).")
    return out


def page(doc: Mapping, files: Collection[str]) -> str:
    meta = doc["meta"]
    window = f", window {meta['window']}" if meta.get("window") else ""
    lines = ["# What antman would buy this cluster", "",
             f"{meta.get('jobs', 0):,} jobs of `{meta.get('trace')}`{window}, replayed on "
             f"{meta.get('nodes')} x {meta.get('gpus_per_node')} GPUs under each policy.", ""]
    lines += answer(doc) + [""]
    lines += ["## Per policy", ""] + table(doc) + [""]
    lines += [f"- `{p}`: {POLICY_LINES[p]}" for p in ORDER if p in doc["policies"]] + [""]
    shown = [(f, caption) for f, caption in PICTURES if f in files]
    if shown:
        lines += ["## Pictures", ""]
        for f, caption in shown:
            lines += [f"![{caption}]({f})", "", f"*{caption}.*", ""]
    lines += ["## What this replay could not know", ""] + caveats(meta) + [""]
    if meta.get("command"):
        lines += ["## How it was made", "", "```sh", meta["command"], "```", "",
                  "Per job: `jobs-POLICY.csv`; every figure: `results.json`; what each means: "
                  "docs/evaluation.md."]
    return "\n".join(lines).rstrip() + "\n"
