"""Issue 15's faults and attacks on a real devcluster, through ``antman bench faults`` (the scenarios
live in slurm_antman/lab/bench/faults.py so that a site can run the same thing): every row 0 jobs lost,
0 doubled, 0 guaranteed restarts, no problem, nothing skipped. Slow (several minutes): `make test-slow`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import TEST_PORT_BASE, _require_slurm
from slurm_antman.lab.bench import faults

@pytest.mark.cluster
@pytest.mark.slow
def test_every_fault_and_attack_loses_doubles_and_restarts_nothing(tmp_path):
    _require_slurm()
    r = subprocess.run([sys.executable, "-m", "slurm_antman.cli", "bench", "faults", "--json", "--dir",
                        str(tmp_path / "faults"), "--port-base", str(TEST_PORT_BASE + 800)],
                       capture_output=True, text=True, timeout=1500)
    doc = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {"faults": []}
    rows = {row["fault"]: row for row in doc["faults"]}
    assert len(rows) == len(faults.SCENARIO_NAMES), (r.returncode, r.stderr[-3000:])
    for name, row in rows.items():
        assert not row["skipped"], f"{name}: skipped: {row['skipped']}"
        assert (row["jobs_lost"], row["jobs_doubled"], row["guaranteed_restarts"]) == (0, 0, 0), row
        assert row["problems"] == [], row
        assert row["recover_s"] is not None and row["recover_s"] >= 0, row
    assert r.returncode == 0, r.stderr[-3000:]


def test_an_unknown_scenario_is_named_with_the_allowed_ones():
    r = subprocess.run([sys.executable, "-m", "slurm_antman.cli", "bench", "faults", "--only", "meteor"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--only meteor: allowed: sidecar_killed" in r.stderr
