"""The simulator's elastic width across nodes (simulator/elastic_array.py, ``elastic_arrays``): a job array
of one-node tasks, as the real path builds it (docs/elastic.md, "Across nodes: a job array";
policy/cluster/preemption.py; torch_patch/elastic_nodes.py). Each rule on a small hand-made cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_antman.lab.bench import simulate as bench_simulate
from slurm_antman.lab.evaluation.locality_data import profile_efficiency, profile_speedup
from slurm_antman.lab.evaluation.simulator import SimConfig
from slurm_antman.lab.evaluation.simulator import elastic_array as EA
from slurm_antman.lab.evaluation.simulator.engine import Simulator
from slurm_antman.lab.evaluation.workloads import assign
from test_simulator_elastic import at, trace
from torch_patch import elastic_nodes

# 3 nodes x 2 GPUs. a's 2-GPU guaranteed job holds node 0 for the whole run. b's 4-GPU elastic job is over
# b's quota (opportunistic) and wider than a node: an array of 2 tasks of 2 GPUs.
LONG = (at(0), 100_000.0, 2, "a")
ARRAY = (at(10), 5000.0, 4, "b")
BASE = dict(nodes=3, gpus_per_node=2, slow_preempt_s=120.0, min_progress=0.01)


class Recorder(Simulator):
    """Logs (time, event, task, its GPUs) for every task start, requeue and MakeEligible, and the
    training's width after each start and requeue."""

    def __init__(self, *a, **kw):
        self.log: list[tuple] = []
        self.widths: list[tuple[float, int, int]] = []  # (time, GPUs training, nodes they are on)
        super().__init__(*a, **kw)

    def _note_width(self, t):
        p = self.jobs[t.array]
        self.widths.append((self.now, len(p.gpus), len({self.gpus[i].node for i in p.gpus})))

    def _task_started(self, t):
        self.log.append((self.now, "start", t.job.job_id, tuple(t.gpus)))
        super()._task_started(t)
        self._note_width(t)

    def _task_leaving(self, t):
        self.log.append((self.now, "requeue", t.job.job_id, tuple(t.gpus)))
        super()._task_leaving(t)
        self._note_width(t)

    def _task_eligible(self, t, start_unix):
        self.log.append((self.now, "eligible", t.job.job_id, start_unix))
        super()._task_eligible(t, start_unix)


def _seed(ids: list[str]) -> int:
    """A seed under which these jobs are resnet50: a pair too slow beside each other for the local policy's
    target even at the minimum share, so the guaranteed one's slow_preempt_s need comes."""
    return next(s for s in range(10_000) if all(assign(i, s).kind == "R50_32" for i in ids))


def run(tmp_path: Path, rows, r50: tuple[int, ...] = (), **kw):
    jobs = trace(tmp_path, rows)
    cfg = dict(policy="antman", seed=_seed([jobs[i].job_id for i in r50]), utilisation="saturated",
               elastic_share=1.0, elastic_arrays=True, **BASE)
    cfg.update(kw)
    sim = Recorder(jobs, SimConfig(**cfg))
    result = sim.run()
    return sim, [sim.jobs[j.job_id] for j in jobs], result.metrics


def events(sim, kind: str, task: str) -> list[tuple]:
    return [e for e in sim.log if e[1] == kind and e[2] == task]


# -- which jobs, and their shape ---------------------------------------------------------------------

def test_an_elastic_job_wider_than_a_node_is_an_array_of_one_node_tasks(tmp_path):
    assert [EA.array_shape(g, 8) for g in (16, 12, 20, 24, 128)] == [(2, 8), (2, 6), (4, 5), (3, 8), (16, 8)]
    sim, (_, b), m = run(tmp_path, [LONG, ARRAY])
    assert b.klass == "opportunistic" and b.tasks == [f"{b.job.job_id}_0", f"{b.job.job_id}_1"]
    tasks = [sim.jobs[t] for t in b.tasks]
    assert [t.job.gpus for t in tasks] == [2, 2] and all(not t.elastic for t in tasks)
    assert m["elastic_arrays"] == 1 and m["jobs_submitted"] == 2  # the tasks are not trace jobs of their own
    # Without the flag the same job stays rigid and is placed whole.
    rigid, (_, rb), rm = run(tmp_path, [LONG, ARRAY], elastic_arrays=False)
    assert not rb.tasks and rm["elastic_arrays"] == 0 and len(rb.gpus) == 4 and not rigid.log


# -- the start: tasks one by one, training from MIN ---------------------------------------------------

@pytest.mark.parametrize("min_tasks", [1, 2])
def test_the_training_starts_at_min_tasks_and_grows_as_more_tasks_start(tmp_path, min_tasks):
    # A second guaranteed job holds node 1 until 51 s, so only one task finds room at 10 s (node 2); the
    # other starts once node 1 is free. With MIN one task the training starts at once at width 2 and grows
    # to 4 then (a width change); with MIN two tasks it starts only then, at 4, and the first task's GPUs
    # were held idle meanwhile.
    rows = [LONG, (at(1), 50.0, 2, "a"), ARRAY]
    sim, (_, short, b), m = run(tmp_path, rows, elastic_array_min_tasks=min_tasks, slots_per_gpu=1)
    t0, t1 = b.tasks
    (s0, _, _, g0), = events(sim, "start", t0)
    (s1, _, _, g1), = events(sim, "start", t1)
    assert s0 == pytest.approx(10.0) and s1 >= short.end
    assert {sim.gpus[i].node for i in g0} != {sim.gpus[i].node for i in g1}
    if min_tasks == 1:
        assert b.first_start == pytest.approx(10.0)
        assert sim.widths == [(s0, 2, 1), (s1, 4, 2)] and m["array_grows"] == 1 and b.width_changes == 1
        assert m["array_idle_gpu_s"] == 0.0
    else:
        assert b.first_start == pytest.approx(s1)
        assert sim.widths == [(s0, 0, 0), (s1, 4, 2)] and m["array_grows"] == 0 and b.width_changes == 0
        assert m["array_idle_gpu_s"] == pytest.approx((s1 - s0) * 2)
    assert m["array_requeues"] == 0 and b.end is not None


def test_tasks_slurm_starts_together_meet_in_one_round(tmp_path):
    sim, (_, b), m = run(tmp_path, [LONG, ARRAY])
    starts = [e[0] for e in sim.log if e[1] == "start"]
    assert starts == [10.0, 10.0] and sim.widths[-1] == (10.0, 4, 2)
    assert b.width_changes == 0 and m["width_changes"] == 0 and b.lost_gpu_s == 0.0


# -- shedding a task -------------------------------------------------------------------------------

@pytest.mark.parametrize("hold", [300.0, 1000.0])
def test_a_shed_task_leaves_the_rest_training_and_comes_back_only_after_the_hold(tmp_path, hold):
    # Task 0 starts on node 2 at 10 s, task 1 on node 1 once the short job there ends. At 100 s a 1-GPU
    # guaranteed job lands on node 1 (best fit), beside task 1: too slow, its slow_preempt_s need (120 s)
    # makes the coordinator requeue task 1 after the grace time. The job trains on at width 2, on task 0.
    # The coordinator makes task 1 eligible at its requeue plus the hold; it starts again then, on node 0,
    # although node 0 is free from 400 s.
    rows = [(at(0), 400.0, 2, "a"), (at(1), 50.0, 2, "a"), ARRAY, (at(100), 50_000.0, 1, "a")]
    sim, (first, _, b, g), m = run(tmp_path, rows, r50=(2, 3), elastic_hold_s=hold, slots_per_gpu=1)
    t0, t1 = b.tasks
    assert {sim.gpus[i].node for i in g.gpus} == {sim.gpus[i].node for i in events(sim, "start", t1)[0][3]}
    (req, _, _, _), = events(sim, "requeue", t1)
    assert 100.0 + 120.0 <= req <= 100.0 + 120.0 + sim.cfg.grace_s + sim.cfg.cycle_s
    assert not events(sim, "requeue", t0)
    assert (req, 2, 1) in sim.widths  # trained on, on task 0 alone
    assert [e[3] for e in events(sim, "eligible", t1)] == [pytest.approx(req + hold)]
    back, _, _, where = events(sim, "start", t1)[-1]
    assert back == pytest.approx(req + hold) and back > first.end and {sim.gpus[i].node for i in where} == {0}
    assert sim.widths[-1] == (back, 4, 2)
    assert m["array_shrinks"] == 1 and m["array_grows"] == 2 and m["array_requeues"] == 0
    assert b.preemptions == b.restarts == 0 and sim.jobs[t1].restarts == 1


def test_losing_the_host_requeues_every_task_and_none_waits_the_hold(tmp_path):
    # Both tasks start at 10 s, task 0 (the rendezvous host) on node 1. The guaranteed job lands beside
    # it: the coordinator preempts the host, and with it task 1 (a whole-job requeue). Both are made
    # eligible at once: task 0 starts again at the requeue on node 2, task 1 once node 1 has room.
    rows = [LONG, ARRAY, (at(100), 400.0, 1, "a")]
    sim, (_, b, g), m = run(tmp_path, rows, r50=(1, 2))
    t0, t1 = b.tasks
    first0 = events(sim, "start", t0)[0][3]
    assert {sim.gpus[i].node for i in g.gpus} == {sim.gpus[i].node for i in first0}
    (r0, _, _, _), = events(sim, "requeue", t0)
    (r1, _, _, _), = events(sim, "requeue", t1)
    assert r0 == r1 and (r0, 0, 0) in sim.widths  # the training stopped with its host
    assert [e[3] for e in events(sim, "eligible", t0)] == [None] == [e[3] for e in events(sim, "eligible", t1)]
    assert events(sim, "start", t0)[-1][0] == pytest.approx(r0)
    assert events(sim, "start", t1)[-1][0] == pytest.approx(g.end) and g.end < r1 + sim.cfg.elastic_hold_s
    assert m["array_requeues"] == 1 and m["array_shrinks"] == 0 and b.preemptions == b.restarts == 1
    assert m["preemptions"] == 1  # the trace job's one requeue, not one per task


def test_the_coordinator_moves_a_crawling_task_alone_and_the_rendezvous_host_with_its_array(tmp_path):
    # No slow_preempt_s need: a task that crawls beside a guaranteed job is moved (policy.cluster.moves)
    # once a better GPU is free. Task 1 crawls on node 1 beside the 1-GPU job from 100 s; node 0 frees at
    # 400 s: task 1 is moved, a shrink, and comes back after the hold, on node 0.
    moving = dict(slow_preempt_s=None, move_after_s=60.0, min_progress=0.5)
    rows = [(at(0), 400.0, 2, "a"), (at(1), 50.0, 2, "a"), ARRAY, (at(100), 50_000.0, 1, "a")]
    sim, (_, _, b, _), m = run(tmp_path, rows, r50=(2, 3), slots_per_gpu=1, **moving)
    t0, t1 = b.tasks
    (req, _, _, _), = events(sim, "requeue", t1)
    assert req >= 400.0 and not events(sim, "requeue", t0)
    assert [e[3] for e in events(sim, "eligible", t1)] == [pytest.approx(req + sim.cfg.elastic_hold_s)]
    assert m["moves"] == 1 and m["array_shrinks"] == 1 and m["array_requeues"] == 0
    # Task 0 crawls beside the 1-GPU job with node 3 free all along: the coordinator moves it with its
    # whole array (policy.cluster.moves; before 61a1dfb it requeued task 0 alone, and task 1 held its GPUs
    # waiting; with 61a1dfb it never moved it, and the training crawled at task 0's pace).
    sim, (_, b, g), m = run(tmp_path, [LONG, ARRAY, (at(100), 50_000.0, 1, "a")], r50=(1, 2), nodes=4, **moving)
    t0 = b.tasks[0]
    assert set(g.gpus) <= set(events(sim, "start", t0)[0][3])  # beside the host
    assert events(sim, "requeue", t0) and m["moves"] >= 1 and m["array_host_alone"] == 0


def test_widths_change_by_whole_tasks_only(tmp_path):
    # Every width the training had in the shed scenario is a whole number of tasks, each task always its
    # G GPUs on one node; the one-node rules never shed a GPU of a task.
    rows = [(at(0), 400.0, 2, "a"), (at(1), 50.0, 2, "a"), ARRAY, (at(100), 50_000.0, 1, "a")]
    sim, (_, _, b, _), m = run(tmp_path, rows, r50=(2, 3), slots_per_gpu=1)
    assert {w for _, w, _ in sim.widths} == {2, 4}
    for _, kind, _, gpus in sim.log:
        if kind in ("start", "requeue"):
            assert len(gpus) == 2 and len({sim.gpus[i].node for i in gpus}) == 1
    assert m["shrinks"] == m["array_shrinks"] and m["grows"] == m["array_grows"]  # none GPU by GPU
    assert all(not sim.jobs[t].off and sim.jobs[t].width_changes == 0 for t in b.tasks)


# -- the cost of a change, the redo and the pace ----------------------------------------------------

def _two_tasks(tmp_path, **kw):
    """2 nodes of 2 GPUs, checkpoints every 100 s; a 4-GPU array of 2 tasks started by hand at 0 (one
    round, width 4 over 2 nodes): (sim, the trace job, task 0, task 1)."""
    jobs = trace(tmp_path, [(at(0), 5000.0, 4, "b")])
    sim = Simulator(jobs, SimConfig(policy="antman", nodes=2, gpus_per_node=2, elastic_share=1.0, elastic_arrays=True,
                                    checkpoint_s=100.0, utilisation="saturated", **kw))
    p = sim.jobs[jobs[0].job_id]
    p.requested = p.klass = "opportunistic"  # (alone, its tenant's quota is the whole cluster)
    sim._submit(p)
    t0, t1 = (sim.jobs[t] for t in p.tasks)
    sim._start(t0, [0, 1])
    sim._start(t1, [2, 3])
    return sim, p, t0, t1


def test_a_change_stops_the_training_and_redoes_the_work_since_its_last_checkpoint(tmp_path):
    # By hand, with no checkpoint asked of the tasks that stay (a site whose agents never heard of it):
    # task 1 is shed at 250 s, 50 s after the checkpoint of 200 s; it starts again at 400 s.
    sim, p, t0, t1 = _two_tasks(tmp_path, checkpoint_on_notice=False)
    name = p.profile.name
    assert p.state == "RUNNING" and p.gpus == [0, 1, 2, 3] and p.width_changes == 0
    assert p.locality == pytest.approx(profile_efficiency(name, 4, 2))
    gpu_rate = min(g.rate[x] for g in sim.gpus for x in g.rate)
    assert p.rate == pytest.approx(gpu_rate * p.locality)
    r4 = p.rate
    shrink, grow = sim.cfg.elastic_array_shrink_s, sim.cfg.elastic_array_grow_s

    sim.now = 250.0
    sim._stop(t1, "preempt")
    assert p.gpus == [0, 1] and p.locality == 1.0 and p.width_changes == 1 and t1.eligible_at == float("inf")
    assert p.work_left == pytest.approx(5000.0 - 250.0 * r4 + 50.0 * r4)  # 50 s since the checkpoint, redone
    assert p.t_last == pytest.approx(250.0 + shrink) and p.lost_gpu_s == pytest.approx(50.0 * 4)
    assert p.rate == pytest.approx(gpu_rate * profile_speedup(name, 2) / profile_speedup(name, 4))
    r2, left = p.rate, p.work_left

    sim.now = 400.0
    sim._start(t1, [2, 3])  # a grow redoes the same: its workers restart from the checkpoint too
    since = (400.0 - (250.0 + shrink)) % 100.0
    assert p.gpus == [0, 1, 2, 3] and p.width_changes == 2
    assert p.work_left == pytest.approx(left - (400.0 - 250.0 - shrink) * r2 + since * r2)
    assert p.t_last == pytest.approx(400.0 + grow)  # but stops for the grow's own gap

    sim.now = 600.0
    sim._stop(t0, "preempt")  # the host alone (the coordinator no longer moves it; the model still
    # handles it): the training stops, task 1 waits for it
    assert p.state == "PENDING" and p.preemptions == 1 and p.rate == 0.0 and t1.state == "RUNNING"
    assert sim.counts["array_host_alone"] == 1
    assert t1.duty == 0.0 and sim.gpus[2].util == sim.gpus[3].util == 0.0  # its workers wait: no load
    sim.now = 700.0
    sim._start(t0, [0, 1])  # the training starts again on both, task 1's GPUs idle meanwhile
    assert p.state == "RUNNING" and sorted(p.gpus) == [0, 1, 2, 3] and sim.array_idle_gpu_s == pytest.approx(100.0 * 2)
    assert t1.duty == p.duty > 0 and sim.gpus[2].util > 0


def test_the_checkpoint_asked_of_the_staying_tasks_bounds_what_a_shed_and_a_grow_redo(tmp_path):
    # As above, with the coordinator's notices: the shed at 250 s was announced at 220 s for its requeue
    # (grace 30 s), so the staying task checkpointed ARRAY_CHECKPOINT_LEAD_S before it, not at 200 s.
    from slurm_antman.policy.cluster import CheckpointNotice
    sim, p, t0, t1 = _two_tasks(tmp_path)
    r4 = p.rate
    sim.now = 220.0
    sim._apply(CheckpointNotice(t0.job.job_id, "node0", 30.0, cause=f"leave:{t1.job.job_id}"))
    assert p.ckpt_at == 250.0 - EA.ARRAY_CHECKPOINT_LEAD_S
    sim.now = 250.0
    sim._stop(t1, "preempt")
    assert p.work_left == pytest.approx(5000.0 - 250.0 * r4 + EA.ARRAY_CHECKPOINT_LEAD_S * r4)
    assert p.lost_gpu_s == pytest.approx(EA.ARRAY_CHECKPOINT_LEAD_S * 4)
    r2, left = p.rate, p.work_left
    # The grow: the join's notice wins the race with the launcher (the devcluster's), ARRAY_JOIN_REDO_S at most.
    sim.now = 400.0
    sim._start(t1, [2, 3])
    assert p.work_left == pytest.approx(left - (400.0 - 250.0 - sim.cfg.elastic_array_shrink_s) * r2
                                        + EA.ARRAY_JOIN_REDO_S * r2)
    # A notice for the moment now (a join the simulated coordinator saw late) is a checkpoint now, not
    # the lead before it; one from before the training's last restart counts for nothing.
    sim.now = 450.0
    sim._apply(CheckpointNotice(t0.job.job_id, "node0", 0.0, cause="join:x:1"))
    assert p.ckpt_at == 450.0
    assert sim._since_checkpoint(p) == 0.0
    p.ckpt_at = p.ckpt_from - 1.0
    assert sim._since_checkpoint(p) == pytest.approx((450.0 - p.ckpt_from) % 100.0)


def _benchmarks_gap(event: str) -> float:
    """The training gap docs/benchmarks.md's "Across nodes: an elastic job array" table gives for ``event``."""
    text = (Path(__file__).parents[1] / "docs" / "benchmarks.md").read_text()
    section = text[text.index("### Across nodes: an elastic job array"):]
    section = section[:section.index("\n#")]
    row = next(line for line in section.splitlines() if line.startswith(f"| **{event}**"))
    return float(row.rsplit("|", 2)[-2].strip(" *s"))


def test_the_change_costs_are_the_devcluster_measured_gaps():
    # docs/benchmarks.md, 2026-11-26, one devcluster run (three hosts, CPU with gloo): a shrink 9.3 s, a
    # grow 3.4 s. A shrink waits out the lost node's heartbeat and the last call as the launcher sets them.
    assert SimConfig.elastic_array_shrink_s == EA.ARRAY_SHRINK_S == _benchmarks_gap("shrink") == 9.3
    assert SimConfig.elastic_array_grow_s == EA.ARRAY_GROW_S == _benchmarks_gap("grow") == 3.4
    assert EA.ARRAY_SHRINK_S > elastic_nodes.KEEP_ALIVE_S * elastic_nodes.KEEP_ALIVE_MISSES + elastic_nodes.LAST_CALL_S


def test_array_flags_are_checked_named_and_off_by_default():
    assert not SimConfig(policy="antman").elastic_arrays and SimConfig(policy="antman").elastic_array_min_tasks == 1
    for kw, flag in ((dict(elastic_array_shrink_s=-1.0), "--elastic-array-shrink-s"),
                     (dict(elastic_array_grow_s=-1.0), "--elastic-array-grow-s"),
                     (dict(elastic_array_min_tasks=0), "--elastic-array-min-tasks")):
        with pytest.raises(ValueError, match=flag):
            SimConfig(policy="antman", **kw)
    a = bench_simulate._parser().parse_args(["--trace", "x"])
    assert not a.elastic_arrays and (a.elastic_array_shrink_s, a.elastic_array_grow_s) == (9.3, 3.4)
    assert a.elastic_array_min_tasks == 1
    a = bench_simulate._parser().parse_args(["--trace", "x", "--elastic-arrays", "--elastic-array-shrink-s", "20",
                                             "--elastic-array-grow-s", "5", "--elastic-array-min-tasks", "2"])
    assert a.elastic_arrays and (a.elastic_array_shrink_s, a.elastic_array_grow_s) == (20.0, 5.0)
    assert a.elastic_array_min_tasks == 2


def test_two_tasks_of_one_array_never_share_a_gpu(tmp_path):
    """2 nodes of 2 GPUs; node 0 is the guaranteed job's for 100,000 s. b's array needs both tasks to
    train (MIN 4 GPUs), so task 0 waits idle on node 1, whose GPUs then qualify for a second job each:
    Slurm offers node 1 to task 1 too. The node policy keeps it off its sibling's GPUs (apart=, as the
    sidecar does), so it waits for node 0, and the two never share a GPU."""
    sim, (_, b), m = run(tmp_path, [LONG, ARRAY], nodes=2, elastic_array_min_tasks=2)
    starts = [e for e in sim.log if e[1] == "start"]
    assert len(b.tasks) == 2 and b.state == "DONE"
    assert m["array_shared_gpu_starts"] == 0
    gpus: dict[str, set] = {}
    for _, _, task, at_gpus in starts:
        gpus.setdefault(task, set()).update(at_gpus)
    assert set(gpus) == set(b.tasks) and not gpus[b.tasks[0]] & gpus[b.tasks[1]], starts
