"""On the devcluster: a real PyTorch job's agent registers with its node's sidecar, with no change
to the training script, and `antman squeue --json` shows its live numbers."""

from __future__ import annotations

import json
import sys
import time
from slurm_antman.lab import jobs

import pytest

pytestmark = pytest.mark.cluster

TRAIN = jobs.script("demo_train.py")


def _squeue(c) -> dict[int, dict]:
    r = c.run([sys.executable, "-m", "slurm_antman.cli", "squeue", "--json"])
    assert r.returncode == 0, r.stderr
    return {j["job_id"]: j for j in json.loads(r.stdout)}


def _why(c, missing: list[int], jobs: dict) -> str:
    """What Slurm, the job and the node's sidecar say about jobs that never showed an iteration time."""
    parts = [f"no iteration_ms for {missing} within 90 s; antman squeue: {jobs}"]
    for j in missing:
        parts.append(c.run(["scontrol", "show", "job", str(j)]).stdout.strip())
        parts.append(c.run(["sacct", "-j", str(j), "-D", "-o", "JobID,State,ExitCode,Reason%40", "-P"]).stdout)
        parts.append(f"output:\n{c.output(j)[-1500:]}")
    log = c.c.dir / "log"
    for name in sorted(p.name for p in log.glob("*")) if log.is_dir() else []:
        if "sidecar" in name or "slurmd" in name or "coordinator" in name:
            lines = (log / name).read_text(errors="replace").splitlines()
            parts.append(f"--- {name} (last 25 lines)\n" + "\n".join(lines[-25:]))
    return "\n".join(parts)


def test_opportunistic_agent_reports_live_numbers(clean_cluster, tmp_path, torch_only_python):
    """The opportunistic job runs in a user's own venv that holds torch and nothing else: the SPANK plugin
    puts the site's agent bundle first on its PYTHONPATH (the job's own entries kept after it), and its
    agent registers as the guaranteed job's (this venv, slurm-antman installed) does."""
    c = clean_cluster
    # Long enough to outlive the wait below on a loaded machine (4000 steps of at least 50 ms).
    # One checkpoint per job: with a shared one, two saves that interleave make one job's os.replace find
    # the other's temporary file gone, and that job dies (the failure seen under 24.11 and 22.05).
    def script(name: str, python: str = sys.executable) -> str:
        return f"#!/bin/bash\necho \"PYTHONPATH=$PYTHONPATH\"\nexec {python} {TRAIN} {tmp_path / name} 4000 0.05\n"
    opp = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-w", "node2", "--export=ALL,PYTHONPATH=/site/lib",
                   script=script("opp.ckpt", str(torch_only_python)))
    g = c.sbatch("--antman=guaranteed", "--gres=gpu:1", "-w", "node2", script=script("guaranteed.ckpt"))
    plain = c.sbatch("--wrap", 'echo "PYTHONPATH=$PYTHONPATH"')
    deadline = time.monotonic() + 90
    jobs: dict[int, dict] = {}
    while time.monotonic() < deadline:
        jobs = _squeue(c)
        if all(jobs.get(j, {}).get("iteration_ms") is not None for j in (opp, g)):
            break
        time.sleep(1)
    missing = [j for j in (opp, g) if jobs.get(j, {}).get("iteration_ms") is None]
    assert not missing, _why(c, missing, jobs)
    o, gj = jobs[opp], jobs[g]
    assert o["class"] == "opportunistic" and gj["class"] == "guaranteed"
    # The loop sleeps 50 ms a step: the agent measured real mini-batches, not a placeholder (no upper
    # bound: on a loaded machine a step can take far longer).
    assert o["iteration_ms"] is not None and o["iteration_ms"] >= 40, o
    assert gj["iteration_ms"] is not None and gj["iteration_ms"] >= 40, gj
    assert 0 < o["compute_share"] <= 1.0
    assert gj["compute_share"] == 1.0 and gj["mem_limit_bytes"] is None  # guaranteed: never limited
    assert isinstance(o["mem_limit_bytes"], int) and o["mem_limit_bytes"] > 0
    assert o["mem_used_bytes"] is not None and o["mem_used_bytes"] > 0
    # The node view agrees: each job is on the GPU squeue names for it.
    r = c.run([sys.executable, "-m", "slurm_antman.cli", "nodes", "--json"])
    assert r.returncode == 0, r.stderr
    node2 = next(n for n in json.loads(r.stdout) if n["name"] == "node2")
    on = {j["job_id"]: gpu["index"] for gpu in node2["gpus"] for j in gpu["jobs"]}
    assert on[opp] == o["gpus"][0] and on[g] == gj["gpus"][0]
    assert c.output(opp).splitlines()[0] == f"PYTHONPATH={c.c.dir / 'lib' / 'agent'}:/site/lib"
    # Not a slurm-antman job: its PYTHONPATH is the submitter's, untouched.
    assert c.wait_output(plain, r"^PYTHONPATH=").strip() == f"PYTHONPATH={c.c.env.get('PYTHONPATH', '')}"

