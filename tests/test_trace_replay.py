"""``antman bench trace`` on the devcluster: a short trace window replayed through real sbatch, Slurm,
sidecars and coordinator with emulated jobs, under antman and exclusive. The accounting must add up
(every submitted job ends exactly once) and the simulator, given the same jobs, must agree with the
replay within the tolerances measured in docs/evaluation.md."""

from __future__ import annotations

import argparse
import json

import pytest

from conftest import TEST_PORT_BASE, _require_slurm
from slurm_antman import bench_trace
from slurm_antman.evaluation import replay as rp

# Two tenants on one node of two emulated GPUs: the first job of each tenant fits its quota
# (guaranteed), the later ones do not (opportunistic, sharing under antman, queueing under exclusive).
TRACE = """timestamp,duration,num_gpus,gpu_time,cluster
2017-10-09 07:00:00,40,1,40,aaaa01
2017-10-09 07:00:01,30,1,30,bbbb02
2017-10-09 07:00:02,40,1,40,aaaa01
2017-10-09 07:00:03,30,1,30,bbbb02
2017-10-09 07:00:04,40,1,40,aaaa01
"""


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    _require_slurm()
    d = tmp_path_factory.mktemp("trace")
    trace = d / "mini.csv"
    trace.write_text(TRACE)
    args = bench_trace._parser().parse_args([
        "--trace", str(trace), "--nodes", "1", "--gpus", "2", "--speedup", "1", "--iter-scale", "0.5",
        "--policy", "exclusive,antman", "--with-simulator", "--max-wall-s", "400",
        "--dir", str(d / "work"), "--port-base", str(TEST_PORT_BASE + 700), "--out", str(d / "out")])
    doc = bench_trace.run(args, log=print)
    return d, doc


def test_every_job_ends_exactly_once_and_the_numbers_are_measured(replayed):
    d, doc = replayed
    assert set(doc["policies"]) == {"exclusive", "antman"}
    for policy, m in doc["policies"].items():
        assert m["jobs_submitted"] == 5 and m["jobs_done"] == 5, (policy, m)
        rows = [r for r in _csv(d / "out" / f"jobs-{policy}.csv")]
        assert len(rows) == 5 and len({r["job_id"] for r in rows}) == 5
        for r in rows:
            assert r["slurm_state"] == "COMPLETED", (policy, r)
            assert float(r["submit_s"]) <= float(r["first_start_s"]) < float(r["end_s"]), (policy, r)
            # One record per rank and run, each run ended exactly once.
            assert int(r["runs"]) == int(r["restarts"]) + 1
        # The submissions span 4 s, while the first jobs start: the makespan is what the replay covers.
        assert 0 < m["mem_util_makespan"] <= 1 and 0 < m["sm_util_makespan"] <= 1
    # Under exclusive nothing shares a GPU; under antman over-quota jobs run opportunistic at once.
    ex, am = doc["policies"]["exclusive"], doc["policies"]["antman"]
    assert am["jobs_by_admitted_class"].get("opportunistic", 0) >= 2
    assert am["queue_delay_mean_s"] < ex["queue_delay_mean_s"]
    saved = json.loads((d / "out" / "results.json").read_text())
    assert saved["agreement"].keys() == {"exclusive", "antman"}
    assert (d / "out" / "simulator" / "results.json").exists()


def test_the_simulator_agrees_with_the_replay(replayed):
    _, doc = replayed
    for policy, agr in doc["agreement"].items():
        assert agr["jobs_done"] == [5, 5]
        for key, (lo, hi) in rp.TOLERANCE.items():
            v = agr[key]
            assert v is not None and lo <= v <= hi, (policy, key, v, doc["policies"][policy][key],
                                                     doc["simulator"]["policies"][policy][key])


def _csv(path):
    import csv

    with open(path) as f:
        return list(csv.DictReader(f))


def test_bad_flags_are_named():
    rc_args = ["--trace", "/nonexistent.csv", "--policy", "fast"]
    assert bench_trace.main(rc_args) == 2
    with pytest.raises(rp.ReplayError, match="--speedup"):
        rp.ReplayConfig(speedup=0)
    assert isinstance(bench_trace._parser().parse_args(["--trace", "x"]), argparse.Namespace)


def test_lost_gpu_time_and_start_overhead_from_records():
    recs = [{"rank": 0, "restart_count": 0, "work_done_s": 10.0, "resumed_from_s": 0.0},
            {"rank": 1, "restart_count": 0, "work_done_s": 10.0, "resumed_from_s": 0.0},
            {"rank": 0, "restart_count": 1, "work_done_s": 20.0, "resumed_from_s": 8.0}]
    assert rp.lost_gpu_s(recs, gpus=2) == 4.0  # 2 s of work after the last checkpoint, on 2 GPUs
    assert rp.lost_gpu_s(recs[:1], gpus=2) == 0.0
    row = {"end_s": 20.0, "first_start_s": 5.0, "duration_s": 10.0, "mean_slowdown": 1.2, "restarts": 0}
    rows = [{**row, "class": "guaranteed", "submitted_as": "guaranteed"},
            # upgraded (throttled before) and restarted jobs say nothing about start-up
            {**row, "end_s": 90.0, "class": "guaranteed", "submitted_as": "opportunistic"},
            {**row, "end_s": 90.0, "restarts": 1, "class": "guaranteed", "submitted_as": "guaranteed"}]
    assert rp.start_overhead(rows) == 3.0
    assert rp.start_overhead(rows[1:2]) is None
