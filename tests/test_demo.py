"""`make demo`: the AntMan loop on one emulated GPU, run as a user runs it, end to end. Its
wall time (under 2 minutes on this machine) is a benchmark figure, not asserted here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TEST_PORT_BASE, _require_slurm

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.demo]


def test_the_demo_shows_shrink_pause_resume_requeue_and_explains_them(tmp_path):
    _require_slurm()
    r = subprocess.run([sys.executable, "-m", "slurm_antman.cli", "demo", "--dir", str(tmp_path / "demo"),
                        "--port-base", str(TEST_PORT_BASE + 900)], cwd=REPO, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "COLUMNS": "200"})
    out = r.stdout
    assert r.returncode == 0, out[-4000:] + r.stderr[-2000:]
    assert "CPU only: the GPU is emulated" in out
    # step 1: the jobs ran on the contending emulated GPU, and the guaranteed job's time beside its
    # neighbour was measured by the sidecar (its number is a benchmark figure, not asserted)
    flat = " ".join(out.split())  # rich folds long lines
    step = flat.split("one contending emulated GPU", 1)[1][:400]
    assert "ms a step alone" in step and "compute share of" in step, step
    assert any((tmp_path / "demo" / "work" / "device" / "node1" / "0").glob(".device.log"))
    # step 2: the limit shrank and the share dropped, with the numbers on screen
    line = next(l for l in out.splitlines() if "bert-opportunistic: memory limit" in l)
    (lim0, lim1), (sh0, sh1) = [
        tuple(float(x.split()[0]) for x in part.split("->"))
        for part in (line.split("memory limit")[1].split(", compute share")[0],
                     line.split("compute share")[1].split(";")[0])]
    # (a share already at its floor, 0.05, cannot drop: the demo says so and shows the limit)
    assert lim1 < lim0 and (sh1 < sh0 or sh0 == sh1 == 0.05), line
    # step 3: PAUSED in antman squeue, then resumed without a restart
    assert "PAUSED" in out and "resumed in place: same process, no restart (restarts=0)" in out
    # step 4: requeued once, resumed from its checkpoint
    assert "requeued through Slurm" in out and "START step=" in out and "restarts=1" in out
    # step 5: explain names the pause, the resume and the requeue with their reasons
    story = out.split("5. antman explain tells the story", 1)[1]
    assert "paused in place on node1" in story and "resumed" in story and "requeue" in story, story[:3000]
    assert "Cluster torn down" in out
