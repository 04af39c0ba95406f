"""The simulator's Slurm placement and backfill (docs/workload_model.md, "Placement, backfill and
locality"): -N semantics, switches, EASY backfill's reservation, and the per-GPU cost of crossing nodes
(Pollux's measurements, locality_data.py). Elastic width: tests/test_simulator_elastic.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_antman.lab.evaluation import traces
from slurm_antman.lab.evaluation.locality_data import profile_efficiency
from slurm_antman.lab.evaluation.simulator import SimConfig, simulate
from slurm_antman.lab.evaluation.simulator.engine import Simulator
from slurm_antman.lab.evaluation.simulator.scheduler import split

HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"


def trace(tmp_path: Path, rows: list[tuple[str, float, int, str]]) -> list[traces.TraceJob]:
    p = tmp_path / "t.csv"
    p.write_text(HEADER + "".join(f"{t},{d},{g},{d * g},{c}\n" for t, d, g, c in rows))
    return traces.load_sorted(p)


def at(s: int) -> str:
    return f"2017-10-01 00:{s // 60:02d}:{s % 60:02d}"


def starts(result) -> dict[str, float]:
    return {row["job_id"]: row["first_start_s"] for row in result.jobs}


def test_split_spreads_gpus_as_evenly_as_they_go():
    assert split(12, 2) == [6, 6] and split(20, 3) == [7, 7, 6] and split(3, 1) == [3]
    assert sum(split(17, 4)) == 17 and max(split(17, 4)) - min(split(17, 4)) <= 1


def test_a_job_that_fits_a_node_waits_for_one_instead_of_spreading(tmp_path):
    # 2 nodes x 4: two 3-GPU jobs leave one GPU on each node. A 2-GPU job waits for a node (-N 1) under
    # Slurm's placement; the old model spread it over the two leftover GPUs at once.
    jobs = trace(tmp_path, [(at(0), 1000.0, 3, "a"), (at(1), 2000.0, 3, "a"), (at(2), 100.0, 2, "a")])
    base = dict(policy="exclusive", nodes=2, gpus_per_node=4, utilisation="saturated")
    nodes = starts(simulate(jobs, SimConfig(**base)))
    spread = starts(simulate(jobs, SimConfig(**base, placement="spread", backfill="first_fit", locality=False)))
    third = jobs[2].job_id
    assert spread[third] == pytest.approx(2.0)
    assert nodes[third] == pytest.approx(1000.0)  # when the first 3-GPU job frees its node


def test_a_job_larger_than_a_node_takes_nodes_evenly_and_pays_for_crossing_them(tmp_path):
    jobs = trace(tmp_path, [(at(0), 1000.0, 6, "a")])
    cfg = SimConfig(policy="exclusive", nodes=2, gpus_per_node=4, utilisation="saturated")
    sim = Simulator(jobs, cfg)
    r = sim.run()
    row = r.jobs[0]
    held = sim.jobs[row["job_id"]].gpus
    assert sorted(sim.gpus[i].node for i in held) == [0, 0, 0, 1, 1, 1]  # [3, 3], not [4, 2]
    eff = profile_efficiency(row["profile"], 6, 2)
    assert eff < 1.0
    assert row["end_s"] - row["first_start_s"] == pytest.approx(1000.0 / eff)
    flat = simulate(jobs, SimConfig(policy="exclusive", nodes=2, gpus_per_node=4, utilisation="saturated",
                                    locality=False)).jobs[0]
    assert flat["end_s"] - flat["first_start_s"] == pytest.approx(1000.0)


def test_a_multi_node_job_goes_under_one_switch_when_one_has_room(tmp_path):
    # 4 nodes x 2, two nodes a switch. Node 1 is busy, so nodes 0, 2 and 3 are free: the 4-GPU job
    # takes 2 and 3 (one switch), not 0 and 2 (the first two in index order).
    jobs = trace(tmp_path, [(at(0), 5000.0, 2, "a"), (at(0), 5000.0, 2, "a"), (at(1), 100.0, 4, "a")])
    sim = Simulator(jobs, SimConfig(policy="exclusive", nodes=4, gpus_per_node=2, nodes_per_switch=2,
                                    utilisation="saturated"))
    sim.run()
    first, second, wide = (sim.jobs[j.job_id] for j in jobs)
    assert {sim.gpus[i].node for i in first.gpus} == {0} and {sim.gpus[i].node for i in second.gpus} == {1}
    # node 0 freed? no: both 2-GPU jobs run 5000 s, on nodes 0 and 1 (best fit, index order)
    assert {sim.gpus[i].node for i in wide.gpus} == {2, 3}
    assert wide.first_start == pytest.approx(1.0)


def test_easy_backfill_reserves_for_the_first_waiting_job_and_lets_short_jobs_past(tmp_path):
    # One node of 4. A holds 2 GPUs until t=1000; B (4 GPUs) must wait for it. C (2 GPUs, 2000 s) would
    # delay B: first-fit starts it at once, EASY does not. D (2 GPUs, 500 s) ends before B's
    # reservation: both start it at once.
    rows = [(at(0), 1000.0, 2, "a"), (at(10), 3000.0, 4, "a"), (at(20), 2000.0, 2, "a"), (at(30), 500.0, 2, "a")]
    jobs = trace(tmp_path, rows)
    a, b, c, d = (j.job_id for j in jobs)
    base = dict(policy="exclusive", nodes=1, gpus_per_node=4, utilisation="saturated")
    easy = starts(simulate(jobs, SimConfig(**base)))
    first = starts(simulate(jobs, SimConfig(**base, backfill="first_fit")))
    assert easy[b] == pytest.approx(1000.0) and easy[d] == pytest.approx(30.0)
    assert easy[c] == pytest.approx(4000.0)  # after B, which its reservation protected
    assert first[c] == pytest.approx(20.0) and first[b] > 1000.0  # B delayed by C


def test_no_reservation_beyond_the_backfill_window(tmp_path):
    # B cannot start before A ends at t=100,000, beyond a 1-day window: it gets no reservation, so C,
    # which would delay it, starts at once (Slurm's bf_window, 1440 minutes by default).
    rows = [(at(0), 100000.0, 2, "a"), (at(10), 1000.0, 4, "a"), (at(20), 200000.0, 2, "a")]
    jobs = trace(tmp_path, rows)
    _, _, c = (j.job_id for j in jobs)
    base = dict(policy="exclusive", nodes=1, gpus_per_node=4, utilisation="saturated")
    assert starts(simulate(jobs, SimConfig(**base)))[c] == pytest.approx(20.0)
    assert starts(simulate(jobs, SimConfig(**base, bf_window_s=200000.0)))[c] > 100000.0


def test_placement_flags_are_checked_and_named():
    for kw, flag in ((dict(placement="rack"), "--placement"), (dict(backfill="conservative"), "--backfill"),
                     (dict(nodes_per_switch=-1), "--nodes-per-switch"), (dict(switch_wait_s=-1.0), "--switch-wait-s"),
                     (dict(bf_window_s=0.0), "bf_window_s")):
        with pytest.raises(ValueError, match=flag):
            SimConfig(policy="exclusive", **kw)


def test_size_buckets_compare_the_same_jobs_under_antman_and_exclusive(tmp_path):
    from slurm_antman.lab.evaluation import size_buckets

    head = "job_id,gpus,class,submit_s,end_s,preemptions\n"
    (tmp_path / "jobs-exclusive.csv").write_text(head + "a,1,guaranteed,0,100,0\nb,4,guaranteed,0,400,0\n"
                                                 "c,4,guaranteed,0,200,0\n")
    (tmp_path / "jobs-antman.csv").write_text(head + "a,1,guaranteed,0,50,0\nb,4,opportunistic,0,300,2\n"
                                              "c,4,guaranteed,0,900,0\n")
    rows = {r["bucket"]: r for r in size_buckets.buckets(size_buckets.load(str(tmp_path)))}
    assert rows["1"]["mean_jct_s"] == {"exclusive": 100.0, "antman": 50.0}
    two = rows["2-4"]
    assert two["jobs"] == 2 and two["opportunistic_jobs"] == 1 and two["opportunistic_preemptions"] == 2
    assert two["opportunistic_vs_exclusive"] == pytest.approx(300 / 400)  # c, guaranteed, is left out
    assert rows[">8"]["jobs"] == 0 and rows[">8"]["opportunistic_vs_exclusive"] is None
    assert size_buckets.main([str(tmp_path / "nowhere")]) == 2
    assert size_buckets.requeue_line(str(tmp_path)) == ""  # no results.json
    (tmp_path / "results.json").write_text(json.dumps({"policies": {"antman": {
        "multi_gpu_whole_requeues": {"rigid": 2, "all_shared": 5}, "width_changes": 9}}}))
    assert size_buckets.requeue_line(str(tmp_path)) == (
        "antman: whole-job requeues of multi-GPU jobs 7 (all_shared 5, rigid 2); width changes 9")
