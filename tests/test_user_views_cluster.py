"""On the devcluster (ordinary users): antman-dev sees its own jobs' live numbers in `antman
squeue`, `antman nodes` and `antman explain` through the coordinator's query endpoint; root's job's
details are null to it and visible to root; nobody sees another user's story; no traceback anywhere."""

from __future__ import annotations

import json
import sys
import time
from slurm_antman.lab import jobs

import pytest

pytestmark = pytest.mark.cluster

TRAIN = jobs.script("demo_train.py")
CLI = [sys.executable, "-m", "slurm_antman.cli"]
DETAILS = ("mem_limit_bytes", "mem_used_bytes", "compute_share", "iteration_ms", "paused")


def _train(path) -> str:
    # As tests/test_cluster_agent.py: an emulated PyTorch job whose agent reports every 50 ms step,
    # long enough to outlive the waits below; one checkpoint per job.
    return f"#!/bin/bash\nexec {sys.executable} {TRAIN} {path} 4000 0.05\n"


def _squeue(run) -> dict[int, dict]:
    r = run([*CLI, "squeue", "--json"])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return {j["job_id"]: j for j in json.loads(r.stdout)}


def _wait(what: str, fn, timeout: float = 120):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(1)
    raise AssertionError(f"{what} within {timeout:g} s; last seen: {last}")


def _log_tail(c) -> str:
    log = c.c.dir / "log" / "coordinator.log"
    return "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else "(no coordinator.log)"


def test_a_user_sees_its_own_jobs_numbers_and_story_and_no_one_elses(clean_cluster, tmp_path):
    c = clean_cluster
    mine = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-w", "node1", script=_train(tmp_path / "mine.ckpt"))
    roots = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-w", "node1", script=_train(tmp_path / "root.ckpt"),
                     as_root=True)
    assert c.show(mine)["UserId"].startswith(c.c.user) and c.show(roots)["UserId"].startswith("root")

    # antman squeue --json as antman-dev: its job's numbers, through the coordinator.
    def dev_sees_own():
        jobs = _squeue(c.run_as_user)
        return jobs if jobs.get(mine, {}).get("iteration_ms") is not None else None
    jobs = _wait(f"antman-dev's job {mine} showing its numbers to antman-dev (coordinator log:\n{_log_tail(c)})",
                 dev_sees_own)
    own = jobs[mine]
    assert own["user"] == c.c.user and own["class"] == "opportunistic" and own["live"] == "coordinator", own
    assert own["iteration_ms"] >= 40 and 0 < own["compute_share"] <= 1.0, own
    assert isinstance(own["mem_limit_bytes"], int) and own["mem_limit_bytes"] > 0, own
    assert own["mem_used_bytes"] is not None and own["mem_used_bytes"] > 0, own

    # Root's job: listed for antman-dev as Slurm lists it, its numbers null; root sees them.
    root_view = _wait(f"root's job {roots} showing its numbers to root",
                      lambda: (lambda j: j if j.get(roots, {}).get("iteration_ms") is not None else None)(
                          _squeue(c.run)))
    assert all(root_view[roots][k] is not None for k in DETAILS) and root_view[mine]["iteration_ms"] is not None
    other = _squeue(c.run_as_user)[roots]
    assert other["user"] == "root" and other["state"] == "RUNNING" and other["gpus"], other
    assert other["live"] == "hidden" and all(other[k] is None for k in DETAILS), other

    # antman nodes as antman-dev: both jobs on node1's GPUs, only its own with numbers.
    r = c.run_as_user([*CLI, "nodes", "--json"])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    node1 = next(n for n in json.loads(r.stdout) if n["name"] == "node1")
    assert node1["live"] == "coordinator" and node1["gpus"], node1
    on = {j["job_id"]: j for g in node1["gpus"] for j in g["jobs"]}
    assert on[mine]["visible"] and on[mine]["mem_used_bytes"] and on[mine]["iteration_ms"], on
    assert not on[roots]["visible"] and all(on[roots][k] is None for k in DETAILS), on

    # antman explain: its own job's story (placed by its sidecar), root's refused in one line.
    def placed(job: int):
        r = c.run([*CLI, "explain", str(job)])  # root reads the audit log itself
        return r if r.returncode == 0 and "placed on node1" in r.stdout else None
    _wait(f"the placement of {mine} in the audit log", lambda: placed(mine))
    _wait(f"the placement of {roots} in the audit log", lambda: placed(roots))
    r = c.run_as_user([*CLI, "explain", str(mine)])
    assert r.returncode == 0 and f"job {mine}:" in r.stdout and "placed on node1" in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    r = c.run_as_user([*CLI, "explain", str(mine), "--json"])
    doc = json.loads(r.stdout)
    assert doc["owner"] == c.c.user and doc["placements"] and doc["via"].startswith("tcp://"), doc
    assert all(rec.get("user") == c.c.user for rec in doc["placements"]), doc  # the audit log names the owner
    r = c.run_as_user([*CLI, "explain", str(roots)])
    assert r.returncode == 1 and r.stdout == "", r.stdout
    assert r.stderr == f"job {roots} is not yours: only its owner and admins see its story\n", r.stderr

    # A closed pipe is no error: `antman squeue | head -1` as antman-dev.
    r = c.run_as_user(["bash", "-c", f"{' '.join(CLI)} squeue | head -1; exit ${{PIPESTATUS[0]}}"])
    assert r.returncode == 0 and "Traceback" not in r.stderr and r.stderr == "", r.stderr
    assert r.stdout.split()[:2] == ["JOBID", "USER"], r.stdout
    c.run(["scancel", str(mine), str(roots)])
