"""The simulator's elastic width (simulator/elastic.py): by default the real path's rules
(slurm_antman.policy.node.core, can_shed and _width_changes), each tested here; the what-ifs that are
not built on the real path (narrow start, growing beside other jobs) only when asked for. Elastic jobs
across nodes (a job array, simulator/elastic_array.py): tests/test_simulator_elastic_array.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_antman.lab.bench import simulate as bench_simulate
from slurm_antman.lab.evaluation import traces
from slurm_antman.lab.evaluation.locality_data import profile_speedup
from slurm_antman.lab.evaluation.simulator import SimConfig, simulate
from slurm_antman.lab.evaluation.simulator.engine import Simulator
from slurm_antman.policy import cluster as cp

HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"


def trace(tmp_path: Path, rows: list[tuple[str, float, int, str]]) -> list[traces.TraceJob]:
    p = tmp_path / "t.csv"
    p.write_text(HEADER + "".join(f"{t},{d},{g},{d * g},{c}\n" for t, d, g, c in rows))
    return traces.load_sorted(p)


def at(s: int) -> str:
    return f"2017-10-01 00:{s // 60:02d}:{s % 60:02d}"


def _r50_seed() -> int:
    """A seed under which the trace's first two jobs (philly-2, philly-3) are resnet50: a pair too slow
    beside each other for the local policy's target even at the minimum share."""
    from slurm_antman.lab.evaluation.workloads import assign

    return next(s for s in range(10_000) if assign("philly-2", s).kind == assign("philly-3", s).kind == "R50_32")


class Recorder(Simulator):
    """Logs every width change: (time, job, GPUs before, GPUs after, the jobs on each GPU it takes,
    the node's opportunistic slots in use)."""

    def __init__(self, *a, **kw):
        self.log: list[tuple] = []
        super().__init__(*a, **kw)

    def _width_change(self, j, gpus, touched):
        before = list(j.gpus)
        others = {i: self.gpus[i].guar + [x for x in self.gpus[i].opp if x != j.job.job_id]
                  for i in gpus if i not in before}
        self.log.append((self.now, j.job.job_id, tuple(before), tuple(gpus), others, list(self.node_opp)))
        super()._width_change(j, gpus, touched)


def run(tmp_path: Path, rows, **kw):
    cfg = dict(policy="antman", seed=_r50_seed(), utilisation="saturated", elastic_share=1.0)
    cfg.update(kw)
    sim = Recorder(trace(tmp_path, rows), SimConfig(**cfg))
    result = sim.run()
    return sim, {row["job_id"]: row for row in result.jobs}, result.metrics


# -- which jobs are elastic ---------------------------------------------------------------------------

def test_only_jobs_that_fit_one_node_are_elastic_unless_elastic_arrays(tmp_path):
    # job_submit.lua refuses an elastic job that may span nodes unless it is a job array: without
    # elastic_arrays a job wider than a node stays rigid.
    jobs = trace(tmp_path, [(at(0), 100.0, 1, "a"), (at(1), 100.0, 4, "a"), (at(2), 100.0, 8, "a")])
    one, four, eight = (j.job_id for j in jobs)
    base = dict(policy="antman", nodes=2, gpus_per_node=4, elastic_share=1.0)
    faithful = Simulator(jobs, SimConfig(**base)).jobs
    assert (faithful[one].elastic, faithful[four].elastic, faithful[eight].elastic) == (False, True, False)
    wide = Simulator(jobs, SimConfig(**base, elastic_arrays=True)).jobs
    assert (wide[one].elastic, wide[four].elastic, wide[eight].elastic) == (False, True, True)


def test_under_spread_placement_an_elastic_job_still_takes_one_node(tmp_path):
    # 2 nodes x 2. a's guaranteed job on GPU 0 is not measured yet when b's opportunistic 2-GPU job
    # comes, so only GPU 1 of node 0 takes it. The spread model (until 2026-11-26) spreads a rigid job
    # over GPUs 1 and 2; an elastic job is kept on one node (max_nodes=1) and takes node 1.
    rows = [(at(0), 10_000.0, 1, "a"), (at(1), 1000.0, 2, "b")]
    base = dict(nodes=2, gpus_per_node=2, placement="spread", backfill="first_fit", locality=False)
    rigid, _, _ = run(tmp_path, rows, elastic_share=0.0, **base)
    elastic, jobs, _ = run(tmp_path, rows, **base)
    b = next(j for j in rigid.jobs.values() if j.job.gpus == 2)
    assert {rigid.gpus[i].node for i in b.gpus} == {0, 1}
    eb = elastic.jobs[b.job.job_id]
    assert eb.elastic and eb.klass == "opportunistic" and {elastic.gpus[i].node for i in eb.gpus} == {1}
    assert jobs[b.job.job_id]["first_start_s"] == pytest.approx(1.0)


# -- the start ---------------------------------------------------------------------------------------

def test_an_elastic_job_waits_for_room_for_all_of_it_unless_the_narrow_start_what_if(tmp_path):
    # a's guaranteed job holds GPU 0; b's elastic 2-GPU job finds room for one GPU only (under
    # no_room=wait the busy GPU is no room). On the real path it waits, as a rigid job does. Under
    # the narrow-start what-if it starts at width 1 at once and takes GPU 0 once a's job is done.
    rows = [(at(0), 3000.0, 1, "a"), (at(100), 8000.0, 2, "b")]
    base = dict(nodes=1, gpus_per_node=2)
    _, rigid, _ = run(tmp_path, rows, elastic_share=0.0, **base)
    a_id, b_id = sorted(rigid)
    _, faithful, fm = run(tmp_path, rows, **base)
    _, narrow, nm = run(tmp_path, rows, elastic_narrow_start=True, **base)
    assert rigid[b_id]["first_start_s"] >= rigid[a_id]["end_s"] - 1e-6  # waited for a room for 2
    assert faithful[b_id]["elastic"] and faithful[b_id]["first_start_s"] == pytest.approx(rigid[b_id]["first_start_s"])
    assert fm["width_changes"] == 0 and faithful[b_id]["end_s"] == pytest.approx(rigid[b_id]["end_s"])
    assert narrow[b_id]["first_start_s"] == pytest.approx(100.0, abs=1.0)
    assert nm["grows"] >= 1 and narrow[b_id]["end_s"] < rigid[b_id]["end_s"]


# -- shedding for a guaranteed job's need ------------------------------------------------------------

def test_an_elastic_job_sheds_the_gpu_a_guaranteed_job_claims_instead_of_being_requeued(tmp_path):
    # One node of 2 GPUs. b's 2-GPU job is over b's quota (opportunistic) and fills both GPUs; a's
    # guaranteed job then lands on GPU 0, where the pair is too slow even at the minimum share
    # (slow_preempt_s 120 s). min_progress and 1 / move_gain are set low so that b's job does not crawl:
    # the shed is the need's. Not elastic, b's job is requeued; elastic, it sheds GPU 0 and trains on at
    # width 1.
    rows = [(at(0), 5000.0, 2, "b"), (at(100), 10_000.0, 1, "a")]
    base = dict(nodes=1, gpus_per_node=2, slow_preempt_s=120.0, min_progress=0.01, move_gain=100.0)
    _, rigid, rm = run(tmp_path, rows, elastic_share=0.0, **base)
    sim, elastic, em = run(tmp_path, rows, **base)
    b_id = next(k for k, r in rigid.items() if r["gpus"] == 2)
    assert rigid[b_id]["class"] == elastic[b_id]["class"] == "opportunistic" and elastic[b_id]["elastic"]
    assert rigid[b_id]["preemptions"] >= 1
    assert em["preemptions"] == 0 and elastic[b_id]["restarts"] == 0
    (t, jid, before, after, _, slots), = sim.log
    assert jid == b_id and sorted(before) == [0, 1] and after == (1,)
    assert t >= 100.0 + 120.0  # at the need, not earlier (no crawl)
    assert slots == [2]  # Slurm's allocation is unchanged: it keeps the shed GPU's slot
    assert elastic[b_id]["end_s"] < rigid[b_id]["end_s"] and em["jobs_done"] == 2
    # Accounted as whole-job requeues of a multi-GPU job, for a need; none once it sheds instead.
    assert rm["multi_gpu_whole_requeues"] == {"need": rigid[b_id]["preemptions"]}
    assert em["multi_gpu_whole_requeues"] == {}


def test_a_job_with_a_guaranteed_neighbour_on_every_gpu_is_moved_whole_and_counted_so(tmp_path):
    # Two nodes of 2 GPUs. b's 2-GPU job is opportunistic (over b's quota of 1) and starts on node 0;
    # a's 2-GPU guaranteed job then lands on both its GPUs (Slurm does not see opportunistic jobs).
    # Giving up one GPU would leave it crawling on the other, so it is moved whole to node 1, and the
    # requeue is counted as all_shared; a job that is not elastic is moved the same way, as rigid.
    rows = [(at(0), 5000.0, 2, "b"), (at(100), 30_000.0, 2, "a")]
    counted = {}
    for share, cause in ((1.0, "all_shared"), (0.0, "rigid")):
        sim, jobs, m = run(tmp_path, rows, nodes=2, gpus_per_node=2, elastic_share=share)
        b = next(r for r in jobs.values() if r["class"] == "opportunistic")
        assert b["gpus"] == 2 and b["preemptions"] == 1 and m["width_changes"] == 0 and m["moves"] == 1
        counted[share] = m["multi_gpu_whole_requeues"]
        assert counted[share] == {cause: 1}
        assert {sim.gpus[i].node for i in sim.jobs[b["job_id"]].gpus} == {1}  # where it ran last
    assert counted[1.0] != counted[0.0]


def test_a_shed_for_a_need_waits_for_no_hold(tmp_path):
    # A 4-GPU elastic job; two guaranteed jobs land on two of its GPUs 100 s apart, each too slow
    # beside it. With a hold far longer than the run it still sheds both GPUs, one change each, and
    # nobody is requeued.
    rows = [(at(0), 5000.0, 4, "b"), (at(100), 50_000.0, 1, "a"), (at(200), 50_000.0, 1, "a")]
    sim, jobs, m = run(tmp_path, rows, nodes=1, gpus_per_node=4, slow_preempt_s=120.0, min_progress=0.01,
                       elastic_hold_s=1e9)
    assert m["preemptions"] == 0 and m["shrinks"] == 2
    (t1, _, _, w1, _, _), (t2, _, _, w2, _, _) = sim.log
    assert len(w1) == 3 and len(w2) == 2 and t2 - t1 < 200.0


def _manual(tmp_path: Path, rows, **kw):
    """A simulator whose jobs are placed by hand (``_put``), to look at one decision."""
    jobs = trace(tmp_path, rows)
    cfg = dict(policy="antman", seed=_r50_seed(), utilisation="saturated", elastic_share=1.0)
    cfg.update(kw)
    sim = Simulator(jobs, SimConfig(**cfg))
    return sim, [sim.jobs[j.job_id] for j in jobs]


def _put(sim: Simulator, j, klass: str, gpus: list[int], t: float) -> None:
    sim.now = t
    j.klass = j.submitted_as = klass
    sim.active[j.job.job_id] = j
    sim._start(j, gpus)


@pytest.mark.parametrize("elastic_newest", [True, False])
def test_only_the_victim_the_local_policy_picks_sheds(tmp_path, elastic_newest):
    # GPU 0 holds an elastic 2-GPU job E, a rigid 1-GPU job R and a guaranteed job with a
    # slow_preempt_s need: the local policy asks the newest opportunistic job to leave. If that is E,
    # E sheds GPU 0 and the need is answered; if it is R, E keeps its GPUs and the need is left to
    # the coordinator.
    sim, (e, r, g) = _manual(tmp_path, [(at(0), 5000.0, 2, "b"), (at(1), 5000.0, 1, "b"), (at(2), 9000.0, 1, "a")],
                             nodes=1, gpus_per_node=2)
    first, second = (r, e) if elastic_newest else (e, r)
    _put(sim, first, "opportunistic", [0, 1] if first is e else [0], 0.0)
    _put(sim, second, "opportunistic", [0, 1] if second is e else [0], 10.0)
    _put(sim, g, "guaranteed", [0], 20.0)
    gpu0 = sim.gpus[0]
    assert e.elastic and not r.elastic and not gpu0.lp_state.preempted
    for x in sim.gpus:
        x.crawl.clear()  # only the need decides here
    sim.now = 30.0
    gpu0.need = cp.PreemptNeed(sim.node_names[0], 0, g.job.job_id, "slow", 30.0)
    slots = list(sim.node_opp)
    sim._elastic_before_cycle()
    if elastic_newest:
        assert e.gpus == [1] and e.off == [0] and gpu0.need is None and e.width_changes == 1
    else:
        assert sorted(e.gpus) == [0, 1] and gpu0.need is not None and e.width_changes == 0
    assert sim.node_opp == slots


# -- shedding when crawling --------------------------------------------------------------------------

def test_a_crawling_elastic_job_sheds_at_once_then_only_after_the_hold(tmp_path):
    # A 4-GPU elastic job; guaranteed jobs land on its GPUs at 100 s and 200 s, and it crawls beside
    # each (no slow_preempt_s need). It sheds the first GPU at the first cycle, without the
    # coordinator's move_after_s (600 s) and without a hold, having never changed width; the second
    # only when the hold (1,000 s) since that change is over.
    rows = [(at(0), 5000.0, 4, "b"), (at(100), 50_000.0, 1, "a"), (at(200), 50_000.0, 1, "a")]
    sim, jobs, m = run(tmp_path, rows, nodes=1, gpus_per_node=4, elastic_hold_s=1000.0)
    assert m["preemptions"] == 0 and m["shrinks"] == 2 and m["grows"] == 0
    (t1, _, b1, w1, _, _), (t2, _, b2, w2, _, _) = sim.log
    assert 100.0 <= t1 <= 100.0 + sim.cfg.cycle_s
    assert t2 == pytest.approx(t1 + 1000.0)
    guar = [sim.jobs[jid].gpus[0] for jid in sorted(jobs, key=lambda k: jobs[k]["first_start_s"]) if jobs[jid]["gpus"] == 1]
    assert set(b1) - set(w1) == {guar[0]} and set(b2) - set(w2) == {guar[1]}  # the GPUs it shared


def test_a_crawling_job_sheds_the_guaranteed_gpu_with_the_lowest_budget_and_nothing_without_one(tmp_path):
    rows = [(at(0), 5000.0, 3, "b"), (at(1), 9000.0, 1, "a"), (at(2), 9000.0, 1, "a")]
    sim, (e, g1, g2) = _manual(tmp_path, rows, nodes=1, gpus_per_node=3)
    _put(sim, e, "opportunistic", [0, 1, 2], 0.0)
    for x in sim.gpus:
        x.crawl.clear()
    sim.gpus[2].crawl[e.job.job_id] = 0.0  # crawling (the rule beside opportunistic jobs) on GPU 2 only
    sim.now = 10.0
    sim._elastic_before_cycle()
    assert sorted(e.gpus) == [0, 1, 2]  # no GPU shared with a guaranteed job: nothing to shed
    _put(sim, g1, "guaranteed", [0], 20.0)
    _put(sim, g2, "guaranteed", [1], 30.0)
    for x in sim.gpus:
        x.crawl.clear()
    sim.gpus[2].crawl[e.job.job_id] = 0.0
    sim.gpus[0].share[e.job.job_id], sim.gpus[1].share[e.job.job_id] = 0.3, 0.1
    sim.now = 40.0
    sim._elastic_before_cycle()
    assert sorted(e.gpus) == [0, 2] and e.off == [1]  # GPU 1: shared with a guaranteed job, lowest budget
    # Crawling again at once: within the hold, nothing changes.
    sim.gpus[2].crawl[e.job.job_id] = 0.0
    sim.now = 40.0 + sim.cfg.elastic_hold_s - 1.0
    sim._elastic_before_cycle()
    assert sorted(e.gpus) == [0, 2] and e.width_changes == 1


# -- growing back ------------------------------------------------------------------------------------

def test_an_elastic_job_grows_back_onto_its_own_gpu_once_idle_after_the_hold(tmp_path):
    # b's 2-GPU elastic job sheds the GPU a short guaranteed job lands on (it crawls there). The
    # guaranteed job is done by 320 s; the job takes its GPU back when the 300 s hold since the shed is
    # over, not before, and the GPU holds nobody else then.
    rows = [(at(0), 5000.0, 2, "b"), (at(100), 50_000.0, 1, "a"), (at(110), 50_000.0, 1, "a"),
            (at(120), 200.0, 1, "a")]
    sim, jobs, m = run(tmp_path, rows, nodes=1, gpus_per_node=4)
    (t1, _, b1, w1, _, s1), (t2, _, b2, w2, others, s2) = sim.log
    shed = set(b1) - set(w1)
    assert len(w1) == 1 and set(w2) - set(b2) == shed and others == {next(iter(shed)): []}
    assert t2 == pytest.approx(t1 + 300.0)
    assert s1 == s2 == [2] and sim.node_opp == [0]  # its slots, kept through the change, freed at its end


def test_an_elastic_job_grows_only_onto_an_idle_gpu_of_its_device_set(tmp_path):
    # b's 2-GPU job (on GPUs 2 and 3) sheds GPU 2 to a long guaranteed job. GPU 0 goes idle at 1,100 s:
    # not in its device set, so on the real path it stays at width 1. The grow-shared what-if takes it.
    rows = [(at(0), 5000.0, 2, "b"), (at(100), 1000.0, 1, "a"), (at(110), 50_000.0, 1, "a"),
            (at(120), 50_000.0, 1, "a")]
    sim, jobs, m = run(tmp_path, rows, nodes=1, gpus_per_node=4)
    b_id = next(k for k, r in jobs.items() if r["gpus"] == 2)
    assert m["shrinks"] == 1 and m["grows"] == 0 and jobs[b_id]["preemptions"] == 0
    what_if, wjobs, wm = run(tmp_path, rows, nodes=1, gpus_per_node=4, elastic_grow_shared=True)
    assert wm["grows"] == 1 and wjobs[b_id]["end_s"] < jobs[b_id]["end_s"]
    assert set(what_if.log[1][3]) - set(what_if.log[1][2]) == {0}
    assert sim.node_opp == what_if.node_opp == [0]


def test_a_grow_needs_the_gpu_empty_and_room_for_the_footprint(tmp_path):
    rows = [(at(0), 5000.0, 2, "b"), (at(1), 5000.0, 1, "b")]
    sim, (e, r) = _manual(tmp_path, rows, nodes=1, gpus_per_node=3)
    _put(sim, e, "opportunistic", [0, 1], 0.0)
    sim._shrink(e, [1])
    assert e.gpus == [0] and e.off == [1] and sim.node_opp == [2]
    _put(sim, r, "opportunistic", [1], 5.0)  # another job on the GPU it shed; GPU 2 is idle but not its own
    sim.now = 400.0
    sim._elastic_before_cycle()
    assert e.gpus == [0]
    sim._finish(r)
    sim.gpus[1].mem_total = e.profile.mem_bytes  # no room for its footprint beside the headroom
    sim._elastic_before_cycle()
    assert e.gpus == [0]
    sim.gpus[1].mem_total = sim.cfg.gpu_mem_bytes
    sim._elastic_before_cycle()
    assert sorted(e.gpus) == [0, 1] and e.off == [] and sim.node_opp == [2]


# -- the change's cost and the pace at a narrower width ---------------------------------------------

def test_each_width_change_stops_the_job_for_the_change_cost(tmp_path):
    # The scenario of the grow-back test: one shed, one grow.
    assert SimConfig(policy="antman").elastic_change_s == 2.2  # the devcluster's measured median
    rows = [(at(0), 5000.0, 2, "b"), (at(100), 50_000.0, 1, "a"), (at(110), 50_000.0, 1, "a"),
            (at(120), 200.0, 1, "a")]
    _, free, fm = run(tmp_path, rows, nodes=1, gpus_per_node=4, elastic_change_s=0.0)
    _, paid, pm = run(tmp_path, rows, nodes=1, gpus_per_node=4, elastic_change_s=100.0)
    b_id = next(k for k, r in free.items() if r["gpus"] == 2)
    assert fm["width_changes"] == pm["width_changes"] == 2
    # 100 s without progress at width 1 (the shed), then 100 s at width 2 (the grow): the work of 100 s
    # at width 1's pace plus 100 s at full pace.
    pace1 = profile_speedup(free[b_id]["profile"], 1) / profile_speedup(free[b_id]["profile"], 2)
    assert paid[b_id]["end_s"] - free[b_id]["end_s"] == pytest.approx(100.0 * pace1 + 100.0)


def test_an_elastic_job_at_half_width_keeps_its_profiles_measured_share_of_its_pace(tmp_path):
    # Under the narrow-start what-if: one node of 4, a's guaranteed job holds 2 GPUs for longer than
    # b's run, so b's elastic 4-GPU job runs its whole life at width 2. Its pace is S(2) / S(4) of its
    # full width's (Pollux's one-node speedups, 0.53 for resnet50), not the 0.5 of linear scaling.
    rows = [(at(0), 100_000.0, 2, "a"), (at(100), 5000.0, 4, "b")]
    sim, jobs, _ = run(tmp_path, rows, nodes=1, gpus_per_node=4, elastic_narrow_start=True)
    b = next(r for r in jobs.values() if r["gpus"] == 4)
    assert b["class"] == "opportunistic" and b["elastic"] and b["width_changes"] == 0
    pace = profile_speedup(b["profile"], 2) / profile_speedup(b["profile"], 4)
    assert pace > 0.5
    assert b["end_s"] - b["first_start_s"] - sim.cfg.start_overhead_s == pytest.approx(5000.0 / pace)


# -- flags -------------------------------------------------------------------------------------------

def test_elastic_flags_are_checked_named_and_off_by_default():
    for kw, flag in ((dict(elastic_share=1.5), "--elastic-share"), (dict(elastic_change_s=-1.0), "--elastic-change-s"),
                     (dict(elastic_hold_s=-1.0), "--elastic-hold-s")):
        with pytest.raises(ValueError, match=flag):
            SimConfig(policy="antman", **kw)
    cfg = SimConfig(policy="antman")
    assert not (cfg.elastic_narrow_start or cfg.elastic_grow_shared or cfg.elastic_arrays)
    a = bench_simulate._parser().parse_args(["--trace", "x"])
    assert a.elastic_change_s == 2.2 and not (a.elastic_narrow_start or a.elastic_grow_shared or a.elastic_arrays)
    a = bench_simulate._parser().parse_args(["--trace", "x", "--elastic-narrow-start", "--elastic-grow-shared",
                                             "--elastic-arrays"])
    assert a.elastic_narrow_start and a.elastic_grow_shared and a.elastic_arrays
