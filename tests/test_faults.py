"""Faults and attacks on a real devcluster, through ``antman bench faults`` (the scenarios
live in slurm_antman/lab/bench/faults.py so that a site can run the same thing): every row 0 jobs lost,
0 doubled, 0 guaranteed restarts, no problem, nothing skipped. Slow (several minutes): `make test-slow`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import TEST_PORT_BASE, _require_slurm
from slurm_antman.lab.bench import faults

# Two scenarios have cluster tests of their own, the same path on the same devcluster, so CI (45
# minutes in all) runs them once: sidecar_killed is test_coordinator_cluster's
# test_sidecar_killed_and_restarted_while_jobs_run_requeues_nothing, coordinator_torn_audit its
# test_coordinator_killed_mid_preemption_with_a_torn_audit_line_loses_and_doubles_nothing. `antman bench
# faults` itself runs all seven (docs/benchmarks.md).
COVERED_ELSEWHERE = ("sidecar_killed", "coordinator_torn_audit")
IN_THIS_TEST = tuple(n for n in faults.SCENARIO_NAMES if n not in COVERED_ELSEWHERE)


def test_the_scenarios_left_to_other_tests_exist():
    assert set(COVERED_ELSEWHERE) <= set(faults.SCENARIO_NAMES) and len(IN_THIS_TEST) == 5


@pytest.mark.cluster
@pytest.mark.slow
def test_every_fault_and_attack_loses_doubles_and_restarts_nothing(tmp_path):
    _require_slurm()
    r = subprocess.run([sys.executable, "-m", "slurm_antman.cli", "bench", "faults", "--json", "--dir",
                        str(tmp_path / "faults"), "--port-base", str(TEST_PORT_BASE + 800),
                        "--only", ",".join(IN_THIS_TEST)],
                       capture_output=True, text=True, timeout=1500)
    doc = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {"faults": []}
    rows = {row["fault"]: row for row in doc["faults"]}
    # A row names its fault in words ("agent SIGKILLed mid-message"), not by its scenario's id.
    assert len(rows) == len(IN_THIS_TEST), (r.returncode, r.stderr[-3000:])
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
