"""A site's own Slurm history as a trace: ``sacct --json`` or ``sacct -P`` output (a file of either, or
what the adapter reads from slurmdbd) turned into the simulator's jobs.

Each allocation (``sacct -X``: steps are not jobs) that ran becomes one job: submitted at its Submit
time, running its Elapsed seconds alone (the run it finished with: sacct -X shows a requeued job's last
one), on the GPUs of its AllocTRES (``gres/gpu``, ``gres/gpu:TYPE``, and an opportunistic job's
``gres/antman_opp``; ReqTRES where nothing was allocated), for its Account as the tenant. What the
history cannot say is counted, not guessed: jobs with no GPU, jobs that never started (cancelled while
pending, or pending now), jobs still running at the time of the dump. What it does not hold at all,
each job's GPU utilisation and memory, the simulator takes from its workload model (``--utilisation``,
``--util-scale``), as it does for Philly, whose trace has none either.

A malformed file raises ``TraceError`` naming the line (``-P``) or the job's index (JSON) and the field."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from .trace_types import TraceError, TraceJob

# What `sacct -P` must print for a replay; --format takes them in any order, more are ignored.
P_FIELDS = ("JobIDRaw", "Account", "Submit", "Start", "End", "ElapsedRaw", "State", "AllocTRES", "ReqTRES")
P_FORMAT = ",".join(P_FIELDS)
# The TRES an allocation's GPUs show as; a typed one (gres/gpu:a100) counts where the untyped is absent.
GPU_TRES = ("gres/gpu", "gres/antman_opp")
# States of an allocation that never ran: nothing to replay.
NEVER_RAN = frozenset({"PENDING", "REQUEUED", "RESIZING", "REVOKED"})
STILL_RUNNING = frozenset({"RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SIGNALING"})


@dataclass
class SacctSkips:
    """Allocations a replay leaves out, and why (counted, so that the report can say so)."""

    no_gpu: int = 0
    never_ran: int = 0
    still_running: int = 0
    states: dict[str, int] = field(default_factory=dict)  # every allocation's state, for the report

    def to_json(self) -> dict:
        return {"no_gpu": self.no_gpu, "never_ran": self.never_ran, "still_running": self.still_running,
                "states": dict(sorted(self.states.items()))}


def is_sacct(path: str | Path) -> Optional[str]:
    """``"json"`` or ``"parsable"`` when ``path`` holds sacct output, else None."""
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
    if head.startswith("{"):
        return "json" if '"jobs"' in head or '"meta"' in head else None
    first = head.splitlines()[0] if head else ""
    return "parsable" if "|" in first and "JobIDRaw" in first.split("|") else None


def gpus_of(tres: str, names: Iterable[str] = GPU_TRES) -> int:
    """GPUs in a TRES string (``billing=4,cpu=4,gres/gpu=2,mem=8G,node=1`` -> 2)."""
    untyped: dict[str, int] = {}
    typed: dict[str, int] = {}
    for item in tres.split(","):
        key, _, value = item.strip().partition("=")
        base, _, kind = key.partition(":")
        if base not in names or not value:
            continue
        count = _count(value)
        if kind:
            typed[base] = typed.get(base, 0) + count
        else:
            untyped[base] = untyped.get(base, 0) + count
    return sum(untyped.get(n, typed.get(n, 0)) for n in names)


def _count(value: str) -> int:
    if not re.fullmatch(r"\d+", value.strip()):
        raise ValueError(f"{value!r} is not a whole number")
    return int(value)


def _time(text: str) -> Optional[float]:
    text = text.strip()
    if text in ("", "Unknown", "None", "N/A"):
        return None
    return datetime.fromisoformat(text).timestamp()


@dataclass(frozen=True, slots=True)
class _Row:
    job_id: str
    account: str
    submit: float
    start: Optional[float]
    elapsed: float
    state: str
    gpus: int


def _keep(row: _Row, skips: SacctSkips) -> bool:
    skips.states[row.state] = skips.states.get(row.state, 0) + 1
    if row.state in STILL_RUNNING:
        skips.still_running += 1
        return False
    if row.start is None or row.state in NEVER_RAN:
        skips.never_ran += 1
        return False
    if row.gpus < 1:
        skips.no_gpu += 1
        return False
    return True


def _parsable(path: str | Path, gpu_tres: tuple[str, ...]) -> Iterator[_Row]:
    with open(path, encoding="utf-8", errors="replace") as f:
        header = f.readline().rstrip("\n").split("|")
        missing = [c for c in P_FIELDS if c not in header]
        if missing:
            raise TraceError(path, 1, None, f"sacct -P output without {', '.join(missing)}: run "
                                            f"sacct -X -P --format={P_FORMAT}")
        col = {name: i for i, name in enumerate(header)}
        for line, text in enumerate(f, start=2):
            text = text.rstrip("\n")
            if not text.strip():
                continue
            cells = text.split("|")
            if len(cells) != len(header):
                raise TraceError(path, line, None, f"{len(cells)} fields, the header names {len(header)}")

            def get(name: str) -> str:
                return cells[col[name]].strip()

            job_id = get("JobIDRaw")
            if "." in job_id:
                continue  # a step (sacct without -X): its allocation's line stands for it
            current = ""
            try:
                current = "Submit"
                submit = _time(get("Submit"))
                if submit is None:
                    raise ValueError("empty")
                current = "Start"
                start = _time(get("Start"))
                current = "ElapsedRaw"
                elapsed = float(_count(get("ElapsedRaw") or "0"))
                current = "AllocTRES"
                gpus = gpus_of(get("AllocTRES"), gpu_tres)
                if not get("AllocTRES"):
                    current = "ReqTRES"
                    gpus = gpus_of(get("ReqTRES"), gpu_tres)
            except ValueError as e:
                raise TraceError(path, line, current, f"{get(current)!r}: {e}") from None
            state = get("State").split()[0] if get("State") else ""
            yield _Row(job_id, get("Account") or "default", submit, start, elapsed, state, gpus)


def _number(value: Any) -> Optional[float]:
    """A sacct JSON number: plain, or ``{"set": true, "infinite": false, "number": N}`` (the form of many
    fields from 23.02 on, e.g. ``time.limit``; those read here were plain in 24.11's and 26.05's output)."""
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if value is None or isinstance(value, bool):
        return None
    if not isinstance(value, (int, float)):
        raise ValueError(f"{value!r} is not a number")
    return float(value)


def _tres_gpus(entries: Any, gpu_tres: tuple[str, ...]) -> int:
    if not isinstance(entries, list):
        raise ValueError("expected a list of {type, name, count}")
    text = ",".join(f"{e.get('type')}/{e.get('name')}={int(_number(e.get('count')) or 0)}"
                    for e in entries if isinstance(e, dict) and e.get("type") == "gres" and e.get("name"))
    return gpus_of(text, gpu_tres)


def _json(path: str | Path, gpu_tres: tuple[str, ...]) -> Iterator[_Row]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise TraceError(path, e.lineno, None, f"not JSON: {e.msg}") from None
    jobs = doc.get("jobs") if isinstance(doc, dict) else None
    if not isinstance(jobs, list):
        raise TraceError(path, None, "jobs", "sacct --json output has no list of jobs")
    for i, j in enumerate(jobs):
        current = "job_id"
        try:
            job_id = str(int(_number(j.get("job_id")) or 0))
            current = "time.submission"
            t = j.get("time") or {}
            submit = _number(t.get("submission"))
            if submit is None:
                raise ValueError("missing")
            current = "time.start"
            start = _number(t.get("start")) or None  # 0: never started
            current = "time.elapsed"
            elapsed = _number(t.get("elapsed")) or 0.0
            current = "tres.allocated"
            tres = j.get("tres") or {}
            gpus = _tres_gpus(tres.get("allocated") or [], gpu_tres)
            if not tres.get("allocated"):
                current = "tres.requested"
                gpus = _tres_gpus(tres.get("requested") or [], gpu_tres)
            current = "state.current"
            st = (j.get("state") or {}).get("current")
            state = st[0] if isinstance(st, list) and st else st
            if not isinstance(state, str):
                raise ValueError(f"{st!r}")
        except (ValueError, TypeError, AttributeError) as e:
            raise TraceError(path, None, current, f"jobs[{i}]: {e}") from None
        yield _Row(job_id, str(j.get("account") or "default"), submit, start, elapsed, state, gpus)


def first_submit_unix(path: str | Path, gpu_tres: tuple[str, ...] = GPU_TRES) -> Optional[float]:
    """The Unix time of the history's first submission among the jobs a replay keeps (its time 0)."""
    return load_with_start(path, None, gpu_tres)[1]


def load(path: str | Path, skips: Optional[SacctSkips] = None,
         gpu_tres: tuple[str, ...] = GPU_TRES) -> list[TraceJob]:
    """The history's jobs that ran on GPUs, by submission, times from the first submission."""
    return load_with_start(path, skips, gpu_tres)[0]


def load_with_start(path: str | Path, skips: Optional[SacctSkips] = None,
                    gpu_tres: tuple[str, ...] = GPU_TRES) -> tuple[list[TraceJob], Optional[float]]:
    """``load``'s jobs and the Unix time they count from, in one pass over a file that can hold months."""
    fmt = is_sacct(path)
    if fmt is None:
        raise TraceError(path, 1, None, "neither sacct --json nor sacct -P output (the -P header needs JobIDRaw)")
    skips = skips if skips is not None else SacctSkips()
    rows = [r for r in (_json(path, gpu_tres) if fmt == "json" else _parsable(path, gpu_tres)) if _keep(r, skips)]
    if not rows:
        return [], None
    t0 = min(r.submit for r in rows)
    # sacct counts whole seconds: a job that ran under one shows 0, and runs one here.
    jobs = [TraceJob(f"slurm-{r.job_id}", r.submit - t0, max(1.0, r.elapsed), r.gpus, r.account) for r in rows]
    return sorted(jobs, key=lambda j: (j.submit_s, j.job_id)), t0
