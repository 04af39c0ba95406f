"""``antman squeue [--json] [--all]``: Slurm's jobs with their slurm-antman class, physical GPUs and
the live numbers the node sidecars report (memory limit and use, compute share, iteration time).

Slurm is the source of truth for jobs; the sidecars only add live numbers, which come through the
coordinator's query endpoint (views/live.py): every user sees every job Slurm shows them, and the live
numbers of their own jobs (an admin: of all). A job whose numbers cannot be had, or are another user's,
keeps them null: that never hides a job or fails the command. ``live`` says which: ``coordinator`` or
``sidecar`` (where the numbers came from), ``hidden`` (another user's job), null (none reported).

JSON: a list of objects. ``gpus`` is a flat list of physical GPU indices (null when the job is not
running); on a multi-node job indices repeat across nodes, so ``gpus_by_node`` ({node: [idx]}) says
which node each belongs to. Live fields of a multi-node job are combined over its nodes: memory
summed, the smallest compute share, the slowest iteration.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional

from ..slurm import Job, default_backend
from ..slurm.models import TERMINAL_STATES
from .live import gather

# States in which a job holds its allocation, so its GPUs are meaningful.
HOLDING_STATES = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING"})
DEFAULT_CONFIG = "/etc/slurm-antman/antman.yaml"


def load_config(args: Optional[argparse.Namespace] = None) -> Any:
    """The antman.yaml the views use, or None when none is installed (then: no sidecar numbers).

    A config that was named explicitly (``--config`` / ANTMAN_CONFIG) and is broken is an error.
    """
    from .. import config as cm

    named = getattr(args, "config", None) or os.environ.get("ANTMAN_CONFIG")
    path = Path(named or DEFAULT_CONFIG)
    if not named and not path.exists():
        return None
    return cm.load(path)


def _live(job: Job, states: dict[str, Any]) -> dict[str, Any]:
    found = []
    source = None
    for node in job.nodes:
        st = states.get(node)
        if st is None:
            continue
        mine = [js for js in st.jobs if js.job_id == str(job.job_id)]
        if mine and source is None:
            source = getattr(st, "source", "sidecar")
        found.extend(mine)
    if not found:
        return {"mem_limit_bytes": None, "mem_used_bytes": None, "compute_share": None, "iteration_ms": None,
                "paused": False, "live": None}
    if not all(getattr(js, "visible", True) for js in found):
        # Another user's job: Slurm shows it to everyone, its numbers are its owner's and the admins'.
        return {"mem_limit_bytes": None, "mem_used_bytes": None, "compute_share": None, "iteration_ms": None,
                "paused": None, "live": "hidden"}
    limits = [js.mem_limit_bytes for js in found]
    used = [js.mem_used_bytes for js in found if js.mem_used_bytes is not None]
    iters = [js.iteration_ms for js in found if js.iteration_ms is not None]
    return {
        "mem_limit_bytes": None if any(v is None for v in limits) else sum(limits),
        "mem_used_bytes": sum(used) if used else None,
        "compute_share": min(js.compute_share for js in found),
        "iteration_ms": max(iters) if iters else None,
        "paused": any(bool(getattr(js, "paused", False)) for js in found),
        "live": source,
    }


def rows(jobs: list[Job], states: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for j in jobs:
        holding = j.state in HOLDING_STATES
        row = {
            "job_id": j.job_id, "display_id": j.display_id, "name": j.name, "user": j.user, "account": j.account,
            "partition": j.partition, "class": j.antman_class, "state": j.state, "reason": j.reason,
            "nodes": j.nodes, "gpus": j.gpus if holding else None,
            "gpus_by_node": j.gpus_by_node if holding else None, "restarts": j.restarts,
        }
        row.update(_live(j, states) if holding else _live(j, {}))
        if row["paused"] and j.state == "RUNNING":
            row["state"] = "PAUSED"  # running in Slurm, its GPU state on the host (pause in place)
        out.append(row)
    return out


def collect(args: argparse.Namespace) -> list[dict[str, Any]]:
    cfg = load_config(args)
    backend = default_backend(gres_name=cfg.slurm.gpu_gres if cfg else "gpu")
    jobs = backend.jobs()
    if not getattr(args, "all", False):
        jobs = [j for j in jobs if j.state not in TERMINAL_STATES]
    wanted = getattr(args, "jobs", None)
    if wanted:
        jobs = [j for j in jobs if selected(j, wanted)]
    # An array's tasks together, in task order, as squeue lists them.
    jobs.sort(key=lambda j: (j.array_job_id or j.job_id, _task_key(j)))
    nodes = [n for j in jobs if j.state in HOLDING_STATES for n in j.nodes]

    states, problem = gather(cfg, nodes, "jobs")
    out = rows(jobs, states)
    warn_unlive("squeue", problem, any(r["live"] is None and r["gpus"] is not None for r in out))
    return out


def warn_unlive(view: str, problem: Optional[str], missing: bool) -> None:
    """One line on stderr when the coordinator could not be asked and numbers are missing for it."""
    if problem and missing:
        print(f"antman {view}: no live numbers from the coordinator: {problem}", file=sys.stderr)


def _task_key(j: Job) -> int:
    task = j.array_task or ""
    return int(task) if task.isdigit() else -1 if not task else 1 << 31


def parse_job_ids(text: str) -> list[str]:
    """``-j 12,34_5,34``: raw ids, array tasks (ARRAY_TASK), or an array's id (all its tasks)."""
    out = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in out if not re.fullmatch(r"[1-9]\d{0,9}(_\d{1,10})?", t)]
    if bad or not out:
        raise ValueError(f"-j {text!r}: expected job ids separated by commas, each JOBID or ARRAYID_TASKID "
                         "(e.g. 12,34_5)")
    return out


def selected(j: Job, wanted: list[str]) -> bool:
    return any(w in (str(j.job_id), j.display_id) or (j.array_job_id and w == str(j.array_job_id)) for w in wanted)


def _gib(v: Optional[int]) -> str:
    return "-" if v is None else f"{v / 2**30:.1f}G"


def _gpus_text(r: dict[str, Any]) -> str:
    by_node = r["gpus_by_node"]
    if not by_node:
        return "-"
    if len(by_node) == 1:
        return ",".join(map(str, next(iter(by_node.values()))))
    return " ".join(f"{n}:{'+'.join(map(str, idx))}" for n, idx in by_node.items())


def console():
    from rich.console import Console

    tty = sys.stdout.isatty()
    return Console(no_color=not tty, highlight=False, width=None if tty else 200, soft_wrap=not tty)


def render_table(data: list[dict[str, Any]]) -> None:
    from rich import box
    from rich.table import Table

    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in ("JOBID", "USER", "NAME", "CLASS", "STATE", "PARTITION", "NODES/REASON", "GPUS", "RESTARTS",
                "MEM USED/LIMIT", "SHARE", "ITER"):
        t.add_column(col, no_wrap=True)
    for r in data:
        where = ",".join(r["nodes"]) if r["gpus"] is not None else f"({r['reason'] or 'None'})"
        mem = "-" if r["mem_used_bytes"] is None else f"{_gib(r['mem_used_bytes'])}/{_gib(r['mem_limit_bytes'])}"
        share = "-" if r["compute_share"] is None else f"{r['compute_share']:.2f}"
        it = "-" if r["iteration_ms"] is None else f"{r['iteration_ms']:.1f}ms"
        t.add_row(str(r.get("display_id") or r["job_id"]), r["user"], r["name"][:20], r["class"], r["state"], r["partition"], where,
                  _gpus_text(r), str(r["restarts"]), mem, share, it)
    console().print(t)


def show(data: list[dict[str, Any]], as_json: bool, render) -> int:
    """What both views print: JSON for scripts, or the table."""
    if as_json:
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render(data)
    return 0


def main(args: argparse.Namespace) -> int:
    return show(collect(args), args.json, render_table)
