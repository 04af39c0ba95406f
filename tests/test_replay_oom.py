"""``antman bench trace --policy shared`` on the devcluster with a GPU too small for two jobs: the job
that arrives second on the GPU fails with CUDA out of memory (Slurm: FAILED), the driver resubmits it
``--oom-retry-s`` later, and it completes once the GPU has room; ``oom_failures`` counts the failed
attempts as the simulator does. One node of one 16 GiB GPU; the seed is the first that makes the first
job gpt2_small (the largest footprint; guaranteed: within its tenant's quota of 1 GPU) and the second
one whose footprint does not fit beside it (opportunistic: over the quota, so it shares the GPU)."""

from __future__ import annotations

import csv

import pytest

from conftest import TEST_PORT_BASE, _require_slurm
from slurm_antman.lab.bench import trace as bench_trace
from slurm_antman.lab.evaluation.workloads import BY_NAME, GiB, assign

TRACE = """timestamp,duration,num_gpus,gpu_time,cluster
2017-10-09 07:00:00,15,1,15,aaaa01
2017-10-09 07:00:03,5,1,5,aaaa01
"""
# A trace replay on its own devcluster (about a minute): `make test-slow`, with the other replays, keeps
# `make test` under its 15 minutes.
pytestmark = pytest.mark.slow

GPU_BYTES = 16 * GiB
SEED = next(s for s in range(10_000) if assign("philly-2", s).name == "gpt2_small"
            and BY_NAME["gpt2_small"].mem_bytes + assign("philly-3", s).mem_bytes > GPU_BYTES)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    _require_slurm()
    d = tmp_path_factory.mktemp("trace-oom")
    trace = d / "oom.csv"
    trace.write_text(TRACE)
    args = bench_trace._parser().parse_args([
        "--trace", str(trace), "--nodes", "1", "--gpus", "1", "--gpu-mem-gib", "16", "--speedup", "1",
        "--iter-scale", "0.5", "--seed", str(SEED), "--policy", "shared", "--oom-retry-s", "8",
        "--with-simulator", "--max-wall-s", "150", "--dir", str(d / "work"),
        "--port-base", str(TEST_PORT_BASE + 760), "--out", str(d / "out")])
    return d, bench_trace.run(args, log=print)


def test_the_second_job_fails_with_oom_is_resubmitted_and_completes(replayed):
    d, doc = replayed
    m = doc["policies"]["shared"]
    with open(d / "out" / "jobs-shared.csv") as f:
        rows = {r["job_id"]: r for r in csv.DictReader(f)}
    assert m["jobs_submitted"] == 2 and m["jobs_done"] == 2, m
    first, second = rows["philly-2"], rows["philly-3"]
    assert (first["submitted_as"], second["submitted_as"]) == ("guaranteed", "opportunistic")
    assert (int(first["ooms"]), int(first["attempts"])) == (0, 1)
    ooms = int(second["ooms"])
    assert ooms >= 1 and int(second["attempts"]) == ooms + 1
    assert m["oom_failures"] == ooms
    for r in rows.values():
        # Every trace job ended exactly once, in its last Slurm job; JCT runs from the first submission.
        assert r["slurm_state"] == "COMPLETED", r
        assert float(r["submit_s"]) <= float(r["first_start_s"]) < float(r["end_s"]), r
        assert int(r["runs"]) == int(r["restarts"]) + 1 and float(r["lost_gpu_s"]) == 0.0
    # The second job waited at least one retry time after its first, failed start.
    assert float(second["end_s"]) - float(second["first_start_s"]) >= 8
    out = (d / "work" / "shared" / "state" / "philly-3.out").read_text()
    want = assign("philly-3", SEED).mem_bytes / GiB
    assert f"CUDA out of memory. Tried to allocate {want:.2f} GiB (GPU 0; 16.00 GiB total capacity" in out


def test_the_simulator_counts_the_same_kind_of_failure(replayed):
    _, doc = replayed
    replay_ooms, sim_ooms = doc["agreement"]["shared"]["oom_failures"]
    assert replay_ooms >= 1 and sim_ooms >= 1, doc["agreement"]["shared"]
    assert doc["simulator"]["policies"]["shared"]["jobs_done"] == 2
