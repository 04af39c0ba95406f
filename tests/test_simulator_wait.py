"""The study of the opportunistic wait (docs/evaluation.md, "Two follow-ups on the whole trace's loss"):
``--wait-study-s`` names the rule that keeps each GPU from a waiting one-GPU opportunistic job without
changing the run, and the what-if ``--no-room-wait-max-s`` bounds the wait (then the job starts as under
fallback)."""

from __future__ import annotations

import pytest

from slurm_antman.lab.evaluation.simulator import SimConfig
from slurm_antman.lab.evaluation.simulator.engine import Simulator

from test_simulator_elastic import at, trace

# Two GPUs, each kept busy (saturated) by a long guaranteed job of a tenant within its quota (one GPU
# each); then tenant b's second job, over its quota, opportunistic: no GPU meets the rules for it.
ROWS = [(at(0), 20_000.0, 1, "a"), (at(1), 20_000.0, 1, "b"), (at(60), 1000.0, 1, "b")]


def _waited(row: dict) -> float:
    return row["first_start_s"] - row["submit_s"]


def _run(tmp_path, **kw):
    cfg = dict(policy="antman", nodes=1, gpus_per_node=2, utilisation="saturated")
    cfg.update(kw)
    jobs = trace(tmp_path, ROWS)
    result = Simulator(jobs, SimConfig(**cfg)).run()
    rows = {r["job_id"]: r for r in result.jobs}
    assert rows[jobs[2].job_id]["class"] == "opportunistic"
    return rows, result.metrics, jobs[2].job_id


def test_the_wait_study_names_the_rule_and_changes_nothing(tmp_path):
    plain, m0, opp = _run(tmp_path)
    studied, m1, _ = _run(tmp_path, wait_study_s=600.0)
    assert "wait_study" not in m0
    assert [(r["job_id"], r["first_start_s"], r["end_s"]) for r in plain.values()] == \
        [(r["job_id"], r["first_start_s"], r["end_s"]) for r in studied.values()]
    study = m1["wait_study"]
    assert study["samples"] >= 1  # taken at scheduling passes, at most once per wait_study_s
    # Beside a saturated guaranteed job the GPU is over the utilisation threshold; never "qualifies".
    rules = {k.split(":")[-1] for k in study if k != "samples"}
    assert rules and "qualifies" not in rules and rules <= {"utilisation", "progress", "slots", "guaranteed",
                                                             "unmeasured", "avoid"}
    assert _waited(plain[opp]) > 10_000  # it waited for the guaranteed job to end


def test_a_bounded_wait_starts_the_job_after_at_most_that_long(tmp_path):
    jobs, _, opp = _run(tmp_path, no_room_wait_max_s=300.0)
    assert 300.0 <= _waited(jobs[opp]) <= 300.0 + 120.0  # within a coordinator pass or so
    with pytest.raises(ValueError, match="--no-room-wait-max-s"):
        SimConfig(no_room_wait_max_s=-1.0)
    with pytest.raises(ValueError, match="--wait-study-s"):
        SimConfig(wait_study_s=0.0)
