"""Jobs on a devcluster: submit, inspect and wait, with back-off polling.

What the cluster tests and the benchmarks that drive the devcluster (``antman bench faults``) share.
``show`` reads ``scontrol show job -o`` with the order-aware parser, because the jobs these callers
submit include hostile ones whose names forge fields.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional, TypeVar

from .cluster import Cluster, ensure_user
from slurm_antman.errors import AntmanError
from slurm_antman.slurm.parsing import parse_scontrol_line

T = TypeVar("T")


class JobsError(AntmanError):
    """A Slurm call failed, or a wait ran out; the message says which job and what was last seen."""


def wait_for(pred: Callable[[], Optional[T]], timeout: float, what: str, step: float = 0.25,
             why: Optional[Callable[[], str]] = None) -> T:
    """Poll ``pred`` until it returns something true; its value, or JobsError after ``timeout`` s, with
    what ``why()`` says about the cluster then (its logs, the jobs' states) when given."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise JobsError(f"timed out after {timeout:g} s waiting for {what}" + (f"\n{why()}" if why else ""))


class ClusterJobs:
    """The devcluster plus the few Slurm calls its drivers need. Job output goes to ``workdir/JOBID.out``.
    Jobs are submitted as the cluster's ordinary user (``as_root=True`` for the few that must not be);
    inspecting, updating and cancelling is the admin's (root)."""

    def __init__(self, cluster: Cluster, workdir: Path):
        self.c = cluster
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.uid, self.gid = ensure_user(cluster.user)
        os.chown(self.workdir, self.uid, self.gid)  # where the user's jobs write their output
        self.workdir.chmod(0o755)

    def run_as_user(self, args, **kw) -> subprocess.CompletedProcess:
        """A command as the cluster's ordinary user, with the cluster's SLURM_CONF."""
        env = dict(kw.pop("env", None) or self.c.env, HOME=f"/home/{self.c.user}", USER=self.c.user,
                   LOGNAME=self.c.user)
        return self.c.run(args, env=env, as_user=(self.uid, self.gid), **kw)

    @property
    def env(self) -> dict[str, str]:
        return self.c.env

    def run(self, args, **kw) -> subprocess.CompletedProcess:
        return self.c.run(args, **kw)

    def sbatch(self, *args: str, script: str | None = None, wrap: str | None = None, expect_ok: bool = True,
               as_root: bool = False):
        """The new job's id; with ``expect_ok=False`` the completed ``sbatch`` process instead."""
        argv = ["sbatch", "--parsable", "-D", str(self.workdir), "-o", str(self.workdir / "%j.out"), *args]
        if wrap is not None:
            argv += ["--wrap", wrap]
        if script is not None:
            path = self.workdir / f"script-{time.monotonic_ns()}.sh"
            path.write_text(script)
            path.chmod(0o644)
            argv.append(str(path))
        r = self.c.run(argv) if as_root else self.run_as_user(argv)
        if not expect_ok:
            return r
        if r.returncode != 0:
            raise JobsError(f"sbatch {' '.join(args)} failed: {r.stderr.strip()}")
        return int(r.stdout.strip().split(";")[0])

    def show(self, job_id: int) -> dict[str, str]:
        """The job's ``scontrol show job`` fields (the first value of a repeated key)."""
        r = self.c.run(["scontrol", "show", "job", "-o", str(job_id)])
        if r.returncode != 0 or not r.stdout.strip():
            raise JobsError(f"scontrol show job {job_id} failed: {r.stderr.strip()}")
        fields: dict[str, str] = {}
        # One job, one record: from 25.11 its SubmitLine= may hold the newlines of an sbatch --wrap script.
        for k, v in parse_scontrol_line(" ".join(r.stdout.strip().splitlines())):
            fields.setdefault(k, v)
        return fields

    def wait_state(self, job_id: int, states: set[str], timeout: float = 60) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        delay = 0.2
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.show(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(delay)
            delay = min(delay * 1.5, 2.0)
        # A job that does not start is most often about its nodes: say what state Slurm has them in.
        sinfo = self.c.run(["sinfo", "-h", "-N", "-o", "%N %T %E"])
        nodes = "; ".join(line.strip() for line in sinfo.stdout.splitlines() if line.strip()) or sinfo.stderr.strip()
        raise JobsError(f"job {job_id} not in {sorted(states)} after {timeout:g} s: {info.get('JobState')} "
                        f"{info.get('Reason')}; nodes: {nodes}")

    def output(self, job_id: int) -> str:
        path = self.workdir / f"{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_output(self, job_id: int, pattern: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = self.output(job_id)
            if re.search(pattern, text, re.M):
                return text
            time.sleep(0.3)
        # Where the job stands in Slurm says why it never printed it (pending for BeginTime, held, ...).
        r = self.c.run(["scontrol", "show", "job", "-o", str(job_id)])
        raise JobsError(f"job {job_id} output never matched {pattern!r} in {timeout:g} s; Slurm: "
                        f"{(r.stdout or r.stderr).strip()[:1500]}\n{text[-2000:]}")

    def cancel_all(self) -> None:
        r = self.c.run(["squeue", "-h", "-o", "%i"])
        ids = r.stdout.split() if r.returncode == 0 else []
        if ids:
            self.c.run(["scancel", *ids])

    def wait_empty(self, timeout: float = 30) -> bool:
        """True once no job is pending, running, completing or suspended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.c.run(["squeue", "-h", "-t", "PD,R,CG,S", "-o", "%i"])
            if r.returncode == 0 and not r.stdout.strip():
                return True
            time.sleep(0.3)
        return False
