"""``antman bench coordinator``: the cycle benchmark runs the real policy on its synthetic cluster."""

from __future__ import annotations

import json

import pytest

from slurm_antman.lab.bench import coordinator as bench_coordinator
from slurm_antman.policy.cluster import CoordinatorState, decide
from slurm_antman.lab.snapshots import PARAMS, synthetic_cluster


def test_synthetic_cluster_has_the_advertised_size_and_exercises_every_rule():
    snap = synthetic_cluster(n_nodes=50, gpus_per_node=8, n_jobs=400, seed=3)
    assert sum(len(n.gpus) for n in snap.nodes) == 400 and len(snap.jobs) == 400
    kinds = {d.kind for d in decide(snap, CoordinatorState.empty(), PARAMS)[0]}
    assert {"set_opp_slots", "upgrade", "preempt_notice", "set_class"} <= kinds


@pytest.mark.slow  # a cycle of 10,000 GPUs: 20-25 s here
def test_main_json_reports_the_cycle(capsys):
    assert bench_coordinator.main(["--json", "--runs", "1"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["cycle_gpus"] == 10_000 and res["cycle_jobs"] == 5_000
    assert 0 < res["cycle_ms_10k"] <= res["cycle_ms_10k_p95"] + 1e-9
    assert res["cycle_decisions"]["set_opp_slots"] > 0


def test_main_rejects_bad_runs(capsys):
    with pytest.raises(SystemExit) as e:
        bench_coordinator.main(["--runs", "0"])
    assert e.value.code == 2 and "--runs must be at least 1" in capsys.readouterr().err
