"""The simulator's backfill (simulator/scheduler.py, backfill="easy") against Slurm's own, on a real
cluster: one node of 4 GPUs, the same four jobs, the same decisions (the model checked
against the devcluster).

A holds 2 GPUs; B wants all 4 and must wait for A; C (2 GPUs, long) would delay B; D (2 GPUs, short)
ends before B could start. Slurm's sched/backfill, planning from the jobs' time limits, starts D and
holds C back; the simulator does the same from the same run times, and its old first-fit model
(backfill="first_fit") would have started C. Slurm plans from time limits, so the test gives each
job a limit equal to the run time the simulator is told.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from slurm_antman.lab.devcluster import cluster as dc
from slurm_antman.lab.evaluation import traces
from slurm_antman.lab.evaluation.simulator import SimConfig, simulate

from conftest import PLAIN_PORT_BASE, _require_slurm, drain

# A cluster of its own for 18 s: `make test-slow` (CI runs it too), keeping `make test` under 15 minutes.
pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# (name, GPUs, time limit in minutes); Slurm's limits are whole minutes, bf_resolution 60 s.
JOBS = (("A", 2, 3), ("B", 4, 2), ("C", 2, 10), ("D", 2, 1))


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    from slurm_antman.slurm import CliBackend

    _require_slurm()
    d = tmp_path_factory.mktemp("backfill-cluster")
    try:
        # bf_interval=1: a backfill pass every second instead of every 30 s, so the test waits seconds.
        c = dc.up(d, nodes=1, gpus=4, cpus=8, port_base=PLAIN_PORT_BASE + 40, plain=True,
                  extra_slurm_conf="SchedulerParameters=bf_interval=1\n")
        b = CliBackend(env=c.env, timeout=30)
        yield b
        drain(b)
    finally:
        dc.down(d)


def _simulated_starts(tmp_path: Path) -> dict[str, dict[str, float]]:
    p = tmp_path / "t.csv"
    rows = [f"2017-10-01 00:00:{k:02d},{limit * 60.0},{gpus},{limit * 60.0 * gpus},a\n"
            for k, (_, gpus, limit) in enumerate(JOBS)]
    p.write_text("timestamp,duration,num_gpus,gpu_time,cluster\n" + "".join(rows))
    jobs = traces.load_sorted(p)
    out = {}
    for backfill in ("easy", "first_fit"):
        r = simulate(jobs, SimConfig(policy="exclusive", nodes=1, gpus_per_node=4, utilisation="saturated",
                                     backfill=backfill))
        by_id = {row["job_id"]: row["first_start_s"] for row in r.jobs}
        out[backfill] = {name: by_id[j.job_id] - j.submit_s for (name, _, _), j in zip(JOBS, jobs)}
    return out


def test_slurm_backfill_decides_as_the_simulator_does(one_node, tmp_path):
    b = one_node
    ids = {}
    for name, gpus, limit in JOBS:
        ids[name] = b.submit(wrap="sleep 600", options=[f"--gres=gpu:{gpus}", f"--time={limit}", "-N", "1",
                                                       "-n", "1", "-J", f"bf-{name}", "-o", "/dev/null"])
        time.sleep(1.0)  # one at a time, in this order: the same priority order as the simulator's
    # Several backfill passes (bf_interval=1), then Slurm's decisions.
    deadline = time.monotonic() + 60
    while True:
        state = {n: b.job(i) for n, i in ids.items()}
        if state["D"].state == "RUNNING" or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    time.sleep(5.0)  # and a few more passes: C must still be held back then
    state = {n: b.job(i) for n, i in ids.items()}
    seen = {n: (j.state, j.reason) for n, j in state.items()}
    assert state["A"].state == "RUNNING", seen
    assert state["D"].state == "RUNNING", seen  # backfilled: it ends before B could start
    assert state["B"].state == "PENDING" and state["B"].reason == "Resources", seen
    assert state["C"].state == "PENDING", seen  # it would delay B

    sim = _simulated_starts(tmp_path)
    easy, first_fit = sim["easy"], sim["first_fit"]
    # The simulator's EASY backfill: A and D at once, B when A ends, C only after B.
    assert easy["A"] == pytest.approx(0.0) and easy["D"] == pytest.approx(0.0)
    assert easy["B"] > 0 and easy["C"] > easy["B"]
    # The old model would have started C at once, which Slurm did not.
    assert first_fit["C"] == pytest.approx(0.0)
