"""``antman bench trace`` on the devcluster: a short trace window replayed through real sbatch, Slurm,
sidecars and coordinator with emulated jobs, under antman and exclusive. The accounting must add up
(every submitted job ends exactly once) and the simulator, given the same jobs, must agree with the
replay within the tolerances measured in docs/evaluation.md."""

from __future__ import annotations

import argparse
import json
import time
import re

import pytest

from conftest import TEST_PORT_BASE, _require_slurm
from slurm_antman.lab.bench import trace as bench_trace
from slurm_antman.lab.evaluation import replay as rp

pytestmark = [pytest.mark.cluster, pytest.mark.slow]  # four minutes of devcluster: `make test-slow`

# Two tenants on one node of two emulated GPUs: the first job of each tenant fits its quota
# (guaranteed), the later ones do not (opportunistic, sharing under antman, queueing under exclusive).
# Jobs of 30 and 20 s (40 and 30 until 2026-11-26: CI's time), still several times the jobs' start-up.
TRACE = """timestamp,duration,num_gpus,gpu_time,cluster
2017-10-09 07:00:00,30,1,30,aaaa01
2017-10-09 07:00:01,20,1,20,bbbb02
2017-10-09 07:00:02,30,1,30,aaaa01
2017-10-09 07:00:03,20,1,20,bbbb02
2017-10-09 07:00:04,30,1,30,aaaa01
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
        hooks = d / "work" / policy / "cluster" / "antman-state" / "hooks.log"
        log = hooks.read_text() if hooks.exists() else ""
        for r in rows:
            assert r["slurm_state"] == "COMPLETED", (policy, r)
            assert float(r["submit_s"]) <= float(r["first_start_s"]) < float(r["end_s"]), (policy, r)
            # One record per rank and run, each run ended exactly once; every restart is either a run
            # or a requeue by the job's Prolog before its task started (opportunistic.no_room: wait).
            refused = len(re.findall(rf"job {r['slurm_job_id']} on \S+: not started, requeued", log))
            assert int(r["runs"]) + refused == int(r["restarts"]) + 1, (policy, r, refused)
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


# --- OOM under shared: the driver's bookkeeping, without a cluster --------------------------------


def _run_of(job_id: str = "philly-3") -> rp._Run:
    from slurm_antman.lab.evaluation.traces import TraceJob
    from slurm_antman.lab.evaluation.workloads import assign

    return rp._Run(TraceJob(job_id, 3.0, 5.0, 1, "aaaa01"), assign(job_id), 3.0, 5.0)


def _submitted(r: rp._Run, slurm_id: int) -> None:
    # what Replay._submit records after sbatch returns
    r.slurm_id = slurm_id
    r.attempts.append(slurm_id)
    r.state, r.retry_at = "PENDING", None


def test_an_oom_failure_waits_the_retry_time_and_is_counted_once():
    r = _run_of()
    _submitted(r, 11)
    rp.observe(r, 11, "RUNNING", False, now=5.0, retry_s=60.0)
    assert r.state == "RUNNING"
    rp.observe(r, 11, "FAILED", True, now=7.0, retry_s=60.0)
    assert (r.state, r.ooms, r.retry_at) == (rp.OOM_RETRY, 1, 67.0)
    assert r.state not in rp._TERMINAL, "a job waiting for its resubmission has not ended"
    # squeue keeps listing the failed job: it is not counted again.
    rp.observe(r, 11, "FAILED", True, now=8.0, retry_s=60.0)
    assert (r.ooms, r.retry_at) == (1, 67.0)
    assert not rp.due_for_retry(r, 66.9) and rp.due_for_retry(r, 67.0)
    _submitted(r, 12)
    assert not rp.due_for_retry(r, 100.0)
    rp.observe(r, 11, "FAILED", True, now=70.0, retry_s=60.0)  # the old attempt, still listed
    assert (r.state, r.ooms) == ("PENDING", 1)
    rp.observe(r, 12, "COMPLETED", False, now=90.0, retry_s=60.0)
    assert (r.state, r.ooms, r.attempts) == ("COMPLETED", 1, [11, 12])


def test_a_failure_without_the_oom_record_is_reported_not_resubmitted():
    r = _run_of()
    _submitted(r, 21)
    rp.observe(r, 21, "FAILED", False, now=5.0, retry_s=60.0)
    assert (r.state, r.ooms, r.retry_at) == ("FAILED", 0, None)
    assert r.state in rp._TERMINAL and not rp.due_for_retry(r, 1e9)
    # Other terminal states are never taken for an OOM, whatever the records say.
    r2 = _run_of()
    _submitted(r2, 22)
    rp.observe(r2, 22, "CANCELLED", True, now=5.0, retry_s=60.0)
    assert (r2.state, r2.ooms) == ("CANCELLED", 0)


def test_oom_record_detection():
    assert rp.oom_failed([{"rank": 0, "oom": False}, {"rank": 1, "oom": True}])
    assert not rp.oom_failed([{"rank": 0, "completed": False}])  # records from before the field
    assert not rp.oom_failed([{"oom": "yes"}]) and not rp.oom_failed([])


def test_a_resubmitted_jobs_row_spans_its_attempts():
    r = _run_of()
    r.attempts, r.slurm_id, r.ooms, r.state = [11, 12], 12, 1, "COMPLETED"
    r.submitted_at, r.submitted_as, r.ran_as = 3.0, "opportunistic", "opportunistic"
    failed = [{"rank": 0, "restart_count": 0, "start_unix": 1000.0, "end_unix": 1001.0, "completed": False,
               "oom": True, "work_done_s": 0.0, "resumed_from_s": 0.0, "mean_slowdown": 1.0}]
    ran = [{"rank": 0, "restart_count": 0, "start_unix": 1062.0, "end_unix": 1070.0, "completed": True,
            "oom": False, "work_done_s": 5.0, "resumed_from_s": 0.0, "mean_slowdown": 1.3}]
    row = rp.job_row(r, [failed, ran], lambda unix: unix - 1000.0 + 4.0)
    assert (row["submit_s"], row["first_start_s"], row["end_s"]) == (3.0, 4.0, 74.0)
    assert (row["ooms"], row["restarts"], row["preemptions"], row["lost_gpu_s"]) == (1, 1, 0, 0.0)
    assert (row["runs"], row["attempts"], row["slurm_job_id"], row["mean_slowdown"]) == (2, 2, 12, 1.3)
    # Not done: the row says so, no end.
    r.state = rp.OOM_RETRY
    assert rp.job_row(r, [failed, ran], lambda u: u)["end_s"] is None


def test_replay_config_checks_memory_and_retry():
    with pytest.raises(rp.ReplayError, match="--gpu-mem-gib must be >= 16"):
        rp.ReplayConfig(gpu_mem_bytes=8 << 30)
    with pytest.raises(rp.ReplayError, match="--oom-retry-s"):
        rp.ReplayConfig(oom_retry_s=-1)
    with pytest.raises(rp.ReplayError, match="--oom-retry-s"):
        rp.ReplayConfig(oom_retry_s=float("nan"))
    from slurm_antman.lab.evaluation.simulator import SimConfig

    assert rp.ReplayConfig().oom_retry_s == SimConfig().oom_retry_s == 60.0


class _FakeSbatch:
    """Stands in for the devcluster's command runner in a test of what the replay hands sbatch."""

    def __init__(self) -> None:
        self.argv: list[list[str]] = []

    def run(self, argv, timeout=60):
        import subprocess

        self.argv.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout="41\n", stderr="")


@pytest.mark.parametrize("contend", [False, True])
def test_the_job_script_runs_on_the_contending_device_only_when_asked(tmp_path, contend):
    from slurm_antman.lab.evaluation.traces import TraceJob

    cfg = rp.ReplayConfig(policy="antman", nodes=1, gpus_per_node=2, contend=contend)
    rep = rp.Replay([TraceJob("philly-3", 3.0, 5.0, 1, "aaaa01")], cfg, tmp_path)
    for d in (rep.state_dir, rep.board_dir, rep.scripts):
        d.mkdir(parents=True)
    rep.cluster = _FakeSbatch()
    rep._wall0 = time.monotonic()  # what run() sets as it starts the clock
    rep._submit(rep.runs[0])
    script = (rep.scripts / "philly-3.sh").read_text()
    assert "slurm_antman.lab.evaluation.emulated_job" in script
    assert ("--contend" in script) is contend
    assert rep.runs[0].slurm_id == 41
    assert bench_trace._parser().parse_args(["--trace", "x"]).contend is True  # the default
    assert bench_trace._parser().parse_args(["--trace", "x", "--no-contend"]).contend is False
