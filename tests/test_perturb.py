"""``antman bench simulate --perturb N`` (lab/evaluation/perturb.py): each policy rerun with its coordinator
cycle shifted by whole seconds, each metric's mean and range reported beside the nominal run."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from slurm_antman.lab.bench import simulate as bench_simulate
from slurm_antman.lab.evaluation import perturb
from slurm_antman.lab.evaluation.simulator import SimConfig

HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"


def test_the_shifts_centre_on_the_nominal_cycle_and_keep_it_positive():
    assert perturb.offsets(1) == [0]
    assert perturb.offsets(4) == [-1, 0, 1, 2]
    assert perturb.offsets(5) == [-2, -1, 0, 1, 2]
    assert perturb.cycles(30.0, 5) == [28.0, 29.0, 30.0, 31.0, 32.0]
    with pytest.raises(ValueError, match="--perturb must be at least 1"):
        perturb.offsets(0)
    with pytest.raises(ValueError, match=r"--cycle-s 2 by -2 s, to 0 s"):
        perturb.cycles(2.0, 5)


def test_the_summary_is_each_metrics_mean_and_range_over_every_run():
    runs = [{"jct_mean_s": 10.0, "moves": 3, "policy": "antman"}, {"jct_mean_s": 14.0, "moves": 5},
            {"jct_mean_s": 12.0}]
    s = perturb.summarize(runs)
    assert s["jct_mean_s"] == {"mean": 12.0, "min": 10.0, "max": 14.0, "runs": [10.0, 14.0, 12.0]}
    assert "moves" not in s  # missing from one run: no mean that would mislead
    assert "policy" not in s  # not one of the summarised metrics


def test_each_run_but_the_nominal_is_simulated_at_its_own_cycle():
    seen: list[float] = []

    def one(cfg):
        seen.append(cfg.cycle_s)
        return SimpleNamespace(metrics={"jct_mean_s": cfg.cycle_s * 10})

    out = perturb.run(SimConfig(policy="antman", cycle_s=30.0), 3, one, {"jct_mean_s": 1.0})
    assert seen == [29.0, 31.0]  # the nominal run is reused, not rerun
    assert out["cycle_s"] == [29.0, 30.0, 31.0]
    assert out["metrics"]["jct_mean_s"]["runs"] == [290.0, 1.0, 310.0]


def test_the_cli_reports_the_runs_beside_the_nominal_result(tmp_path, capsys):
    t = tmp_path / "t.csv"
    t.write_text(HEADER + "".join(f"2017-10-01 00:{i:02d}:00,{600 + 60 * i},{1 + i % 2},1,{'ab'[i % 2]}\n"
                                  for i in range(12)))
    out = tmp_path / "out"
    assert bench_simulate.main(["--trace", str(t), "--nodes", "1", "--gpus", "2", "--policy", "exclusive,antman",
                                "--perturb", "3", "--json", "--out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    meta = doc["meta"]
    assert meta["perturb_cycles_s"] == [29.0, 30.0, 31.0]
    for policy in ("exclusive", "antman"):
        jct = meta["perturbed"][policy]["metrics"]["jct_mean_s"]
        assert len(jct["runs"]) == 3 and jct["runs"][1] == doc["policies"][policy]["jct_mean_s"]
        assert jct["min"] <= jct["mean"] <= jct["max"]
    assert json.loads((out / "results.json").read_text())["meta"]["perturbed"] == meta["perturbed"]
    assert bench_simulate.main(["--trace", str(t), "--perturb", "0"]) == 2
    assert "--perturb must be at least 1" in capsys.readouterr().err
