"""The simulator's Slurm placement and backfill (issue 29): -N semantics, switches, EASY backfill's
reservation, and the per-GPU cost of crossing nodes (Pollux's measurements, locality_data.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_antman.lab.evaluation import traces
from slurm_antman.lab.evaluation.locality_data import profile_efficiency, profile_speedup
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


def _r50_seed() -> int:
    from slurm_antman.lab.evaluation.workloads import assign

    return next(s for s in range(10_000) if assign("philly-2", s).kind == assign("philly-3", s).kind == "R50_32")


def test_an_elastic_job_gives_up_the_reclaimed_gpu_instead_of_being_requeued(tmp_path):
    # One node of 2 GPUs. b's 2-GPU job is over b's quota (opportunistic) and fills both GPUs; a's
    # guaranteed job then lands on GPU 0, where the pair is too slow even at the minimum share
    # (slow_preempt_s). Not elastic, b's job is requeued and waits for a room for 2 GPUs; elastic, it
    # sheds GPU 0 and trains on at half width, with nothing lost.
    jobs = trace(tmp_path, [(at(0), 5000.0, 2, "b"), (at(100), 10_000.0, 1, "a")])
    b_id = jobs[0].job_id
    base = dict(policy="antman", nodes=1, gpus_per_node=2, seed=_r50_seed(), utilisation="saturated",
                slow_preempt_s=120.0)
    rigid = simulate(jobs, SimConfig(**base))
    elastic = simulate(jobs, SimConfig(**base, elastic_share=1.0))
    rb = next(x for x in rigid.jobs if x["job_id"] == b_id)
    eb = next(x for x in elastic.jobs if x["job_id"] == b_id)
    assert rb["class"] == eb["class"] == "opportunistic" and eb["elastic"]
    assert rb["preemptions"] >= 1
    assert elastic.metrics["preemptions"] == 0 and eb["restarts"] == 0
    assert elastic.metrics["shrinks"] >= 1 and eb["width_changes"] >= 1
    assert eb["end_s"] < rb["end_s"]
    assert elastic.metrics["jobs_done"] == 2


def test_an_elastic_job_starts_narrow_and_grows_when_room_comes(tmp_path):
    # a's guaranteed job holds GPU 0; b's elastic 2-GPU job finds room for one GPU only (under
    # no_room=wait the busy GPU is no room): it starts at width 1 instead of waiting, and takes GPU 0
    # once a's job is done and the hold is over.
    jobs = trace(tmp_path, [(at(0), 3000.0, 1, "a"), (at(100), 8000.0, 2, "b")])
    a_id, b_id = (j.job_id for j in jobs)
    base = dict(policy="antman", nodes=1, gpus_per_node=2, seed=_r50_seed(), utilisation="saturated")
    rigid = {x["job_id"]: x for x in simulate(jobs, SimConfig(**base)).jobs}
    r = simulate(jobs, SimConfig(**base, elastic_share=1.0))
    el = {x["job_id"]: x for x in r.jobs}
    assert rigid[b_id]["first_start_s"] >= rigid[a_id]["end_s"] - 1e-6  # waited for a room for 2
    assert el[b_id]["first_start_s"] == pytest.approx(100.0, abs=1.0)
    assert r.metrics["grows"] >= 1 and el[b_id]["end_s"] < rigid[b_id]["end_s"]


def test_an_elastic_job_at_half_width_keeps_its_profiles_measured_share_of_its_pace(tmp_path):
    # One node of 4: a's guaranteed job holds 2 GPUs for longer than b's run, so b's elastic 4-GPU job
    # runs its whole life at width 2. Its pace is S(2) / S(4) of its full width's (Pollux's one-node
    # speedups, 0.53 for resnet50), not the 0.5 of linear scaling.
    jobs = trace(tmp_path, [(at(0), 100_000.0, 2, "a"), (at(100), 5000.0, 4, "b")])
    cfg = SimConfig(policy="antman", nodes=1, gpus_per_node=4, seed=_r50_seed(), utilisation="saturated",
                    elastic_share=1.0)
    b = next(x for x in simulate(jobs, cfg).jobs if x["job_id"] == jobs[1].job_id)
    assert b["class"] == "opportunistic" and b["elastic"] and b["width_changes"] == 0
    pace = profile_speedup(b["profile"], 2) / profile_speedup(b["profile"], 4)
    assert pace > 0.5
    assert b["end_s"] - b["first_start_s"] - cfg.start_overhead_s == pytest.approx(5000.0 / pace)


def test_elastic_flags_are_checked_and_named():
    for kw, flag in ((dict(elastic_share=1.5), "--elastic-share"), (dict(elastic_change_s=-1.0), "--elastic-change-s"),
                     (dict(elastic_hold_s=-1.0), "--elastic-hold-s")):
        with pytest.raises(ValueError, match=flag):
            SimConfig(policy="antman", **kw)


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
