"""``antman explain JOBID [--json]``: the coordinator's decisions about one job, in order, with why.

Reads the audit log where this host has it and the caller may read it (an admin on the coordinator's
host: it works while the coordinator is down and shows history Slurm has already forgotten). Anyone
else, on any host, asks the coordinator's query endpoint, which answers a job's owner and the admins
only (coordinator/query.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Iterable, Optional

from slurm_antman import config as cfgmod

from . import audit

_VERBS = {
    "set_class": "class set to {to_class}",
    "hold_for_quota": "held: tenant over quota",
    "release_hold": "hold released",
    "upgrade": "upgraded to guaranteed (no restart)",
    "preempt_notice": "preemption notice (grace {grace_s:g} s) on {node}",
    "requeue": "requeued",
    "make_eligible": "made eligible again at once",
    "keep_off": "kept off node(s) {nodes_text}",
    "checkpoint_notice": "asked to checkpoint in {at_s:g} s (a task of its elastic array leaves or joins)",
    "placed": "placed on {node} GPU(s) {gpus} by its sidecar ({placement})",
    "paused": "paused in place on {node} by its sidecar (GPU state moved to host memory)",
    "resumed": "resumed on {node} by its sidecar",
}


def records_for(job_id: str, records: Iterable[dict]) -> list[dict]:
    out: list[dict] = []
    last_placed: Optional[tuple] = None
    for r in records:
        if str(r.get("job_id", "")) != job_id or r.get("kind") not in _VERBS:
            continue
        if r["kind"] == "placed":
            # A restarted coordinator writes the placements it finds once more: one line each.
            key = (r.get("node"), json.dumps(r.get("params"), sort_keys=True), r.get("reason"))
            if key == last_placed:
                continue
            last_placed = key
        out.append(r)
    return out


def _line(r: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(r.get("ts", 0))))
    try:
        params = r.get("params") or {}
        nodes_text = ", ".join(params.get("nodes") or []) or "none (every node it may use has room)"
        what = _VERBS[r["kind"]].format(**params, node=r.get("node", "?"), nodes_text=nodes_text)
        if r["kind"] == "preempt_notice" and (r.get("inputs") or {}).get("move"):
            what = what.replace("preemption notice", "move notice (crawling)")
    except (KeyError, ValueError):
        what = r["kind"]
    out = f"{when}  {what}"
    if r.get("outcome") != "ok":
        out += f"  [{r.get('outcome')}: {r.get('error') or r.get('detail') or ''}]"
    out += f"\n    why: {r.get('reason') or '(no reason recorded)'}"
    inputs = r.get("inputs") or {}
    if inputs:
        out += "\n    based on: " + ", ".join(f"{k}={v}" for k, v in inputs.items())
    if r.get("outcome") == "ok" and r.get("detail"):
        out += f"\n    done: {r['detail']}"
    return out


def explain(job_id: str, audit_path: str, as_json: bool = False) -> tuple[str, int]:
    """(text to print, exit status): 0 with decisions, 1 when the log has none about the job."""
    return render(job_id, records_for(job_id, audit.read(audit_path)), audit_path, as_json)


def render(job_id: str, recs: list[dict], audit_path: str, as_json: bool = False,
           extra: Optional[dict] = None) -> tuple[str, int]:
    """``recs`` (the job's records, oldest first) as explain prints them; ``extra``: more JSON fields."""
    if as_json:
        # Decisions are the coordinator's; placements are what the sidecars reported having done.
        doc = {"job_id": job_id, "audit_log": audit_path,
               "decisions": [r for r in recs if r["kind"] not in ("placed", "paused", "resumed")],
               "placements": [r for r in recs if r["kind"] == "placed"],
               "pauses": [r for r in recs if r["kind"] in ("paused", "resumed")], **(extra or {})}
        return json.dumps(doc, indent=2), 0 if recs else 1
    if not recs:
        return (f"job {job_id}: no coordinator decision about this job in {audit_path} "
                "(it kept the class it was submitted with)"), 1
    return f"job {job_id}: {len(recs)} coordinator record(s)\n" + "\n".join(_line(r) for r in recs), 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("job_id", help="Slurm job id, or ARRAYID_TASKID for an array task (as squeue shows it)")
    ap.add_argument("--json", action="store_true",
                    help="print the job's records as JSON: decisions, placements and pauses")
    ap.add_argument("--config", default=None, help="antman.yaml (default: $ANTMAN_CONFIG or /etc/slurm-antman/antman.yaml)")
    ap.add_argument("--audit-log", default=None, help="read this audit log instead of the configured one")


_JOB_ARG = re.compile(r"^[1-9]\d{0,9}(_\d{1,10})?$")


def _known_to_slurm(job: str, gres: str) -> tuple[Optional[str], bool]:
    """(raw job id or None, whether Slurm could be asked). The audit log is keyed by the raw id
    (SLURM_JOB_ID, what nodes and agents know); an array task is asked for as ARRAY_TASK, as squeue
    shows it."""
    from slurm_antman.slurm import SlurmError, default_backend

    try:
        raw = default_backend(gres_name=gres).resolve(int(job) if job.isdigit() else job)
    except SlurmError:
        return None, False
    return (str(raw) if raw is not None else None), True


def _readable(path: str) -> bool:
    # Any of the log's files: after a logrotate rename PATH is missing until the coordinator reopens it.
    return any(os.path.isfile(p) and os.access(p, os.R_OK) for p in audit.files(path))


def _task_raw_id(task: str, gres: str) -> Optional[str]:
    """The raw id of array task ``task`` (ARRAY_TASK), or None after saying why there is none."""
    known, asked = _known_to_slurm(task, gres)
    if known is None:
        print(f"job {task} does not exist (neither slurmctld nor accounting knows it)" if asked else
              f"antman explain: cannot reach Slurm to find array task {task}; give its raw job id "
              "(squeue -o %A)", file=sys.stderr)
    return known


def run(a: argparse.Namespace) -> int:
    if not _JOB_ARG.match(a.job_id):
        print(f"antman explain: job id {a.job_id!r} is not a job: give JOBID or, for an array task, "
              "ARRAYID_TASKID (e.g. 1234 or 1234_7)", file=sys.stderr)
        return 2
    path, gres, cfg = a.audit_log, "gpu", None
    if path is None:
        try:
            cfg = cfgmod.load(a.config or os.environ.get("ANTMAN_CONFIG", "/etc/slurm-antman/antman.yaml"))
        except cfgmod.ConfigError as e:
            print(str(e), file=sys.stderr)
            return 2
        path, gres = cfg.coordinator.audit_log, cfg.slurm.gpu_gres
        address = cfg.coordinator.query_address()
        if not _readable(path) and address is not None:
            return _run_remote(a, address, path, gres)
    raw = a.job_id
    if a.job_id.isdigit():
        if not records_for(raw, audit.read(path)):
            known, asked = _known_to_slurm(raw, gres)
            if asked and known is None:
                print(f"job {a.job_id} does not exist (neither slurmctld nor accounting knows it)", file=sys.stderr)
                return 1
    else:
        raw = _task_raw_id(a.job_id, gres)
        if raw is None:
            return 1
    text, rc = explain(raw, path, a.json)
    if raw != a.job_id and not a.json:
        text = text.replace(f"job {raw}:", f"job {a.job_id} (raw id {raw}):", 1)
    print(text)
    return rc


def _run_remote(a: argparse.Namespace, address: str, path: str, gres: str) -> int:
    """explain through the coordinator: this host has no audit log the caller may read."""
    from slurm_antman.clients import coordinator_query

    raw = a.job_id if a.job_id.isdigit() else _task_raw_id(a.job_id, gres)
    if raw is None:
        return 1
    try:
        reply = coordinator_query.explain(address, raw)
    except coordinator_query.QueryRefused as e:
        if e.code == "forbidden":
            print(e.message if e.message.startswith(("job ", "cannot tell")) else
                  f"job {a.job_id} is not yours: only its owner and admins see its story", file=sys.stderr)
        else:
            print(f"antman explain: {e}", file=sys.stderr)
        return 1
    except coordinator_query.QueryError as e:
        print(f"antman explain: {e}", file=sys.stderr)
        return 1
    recs = records_for(raw, reply.records)
    if not recs and a.job_id.isdigit():
        known, asked = _known_to_slurm(raw, gres)
        if asked and known is None:
            print(f"job {a.job_id} does not exist (neither slurmctld nor accounting knows it)", file=sys.stderr)
            return 1
    if a.json:
        text, rc = render(raw, recs, path, True, {"via": address, "owner": reply.owner, "omitted": reply.omitted})
    else:
        text, rc = render(raw, recs, f"{path} (the coordinator's, asked at {address})")
    if not a.json:
        if reply.omitted:
            text += f"\n({reply.omitted} older record(s) left out to fit one answer)"
        if raw != a.job_id:
            text = text.replace(f"job {raw}:", f"job {a.job_id} (raw id {raw}):", 1)
    print(text)
    return rc


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="antman explain", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
