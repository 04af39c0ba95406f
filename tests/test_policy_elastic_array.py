"""The coordinator's policy core and an elastic-across-nodes job array (docs/elastic.md, "Across
nodes"): a task it sheds waits the hold before it may start again; the task hosting the rendezvous
takes every running task of its array with it; the snapshot builder tells both from Slurm's jobs."""

from __future__ import annotations

import dataclasses
import time

from slurm_antman import config as cfgmod
from slurm_antman.coordinator import snapshot_builder
from slurm_antman.jobtag import JobTag
from slurm_antman.lab.snapshots import NOW, PARAMS, gpu, job, need, node, snap
from slurm_antman.policy.cluster import CoordinatorState, MakeEligible, PreemptNotice, Requeue, decide
from slurm_antman.slurm.models import Job

HOLD = 120.0
P = dataclasses.replace(PARAMS, elastic_hold_s=HOLD)


def _task(job_id: str, node_name: str, host: bool, **kw):
    v = job(job_id, state="RUNNING", requested="opportunistic", job_class="opportunistic", node=node_name,
            start=NOW - 100, **kw)
    return dataclasses.replace(v, elastic_group="500", elastic_host=host)


def _setup():
    """Guaranteed g1 on n2 GPU 0 beside task t1 of array 500; t0 (the host) on n1; o9, a plain job,
    on n3."""
    t0, t1 = _task("t0", "n1", True), _task("t1", "n2", False)
    g1 = job("g1", state="RUNNING", job_class="guaranteed", node="n2")
    nodes = [node("n1", (gpu(0, o=("t0",)),), configured=2, in_slurm=1),
             node("n2", (gpu(0, g=("g1",), o=("t1",)),), configured=2, in_slurm=1)]
    return [g1, t0, t1], nodes


def test_a_shed_task_alone_is_requeued_and_waits_the_hold():
    jobs, nodes = _setup()
    ds, st = decide(snap(jobs, nodes, needs=[need("g1", "n2")]), CoordinatorState.empty(), P)
    assert [d for d in ds if d.kind == "preempt_notice"] == [PreemptNotice("t1", "n2", 30.0)]
    assert "train on without it" in ds[0].reason
    ds, st = decide(snap(jobs, nodes, needs=[need("g1", "n2")], now=NOW + 30), st, P)
    assert [d for d in ds if d.kind == "requeue"] == [Requeue("t1")]
    pending = dataclasses.replace(jobs[2], state="PENDING", node=None, start_unix=None, restarts=1)
    ds, st = decide(snap([jobs[0], jobs[1], pending], nodes, now=NOW + 31), st, P)
    made = [d for d in ds if d.kind == "make_eligible"]
    assert made == [MakeEligible("t1", start_unix=NOW + 30 + HOLD)]
    assert "hold" in made[0].reason


def test_the_rendezvous_host_takes_its_whole_array_with_it():
    jobs, nodes = _setup()
    # The claim is on n1 now, where the host runs.
    g0 = job("g0", state="RUNNING", job_class="guaranteed", node="n1")
    nodes[0] = node("n1", (gpu(0, g=("g0",), o=("t0",)),), configured=2, in_slurm=1)
    ds, st = decide(snap([*jobs, g0], nodes, needs=[need("g0", "n1")]), CoordinatorState.empty(), P)
    notices = [d for d in ds if d.kind == "preempt_notice"]
    assert notices == [PreemptNotice("t0", "n1", 30.0), PreemptNotice("t1", "n2", 30.0)]
    assert "every running task" in notices[0].reason and "rendezvous host t0" in notices[1].reason
    ds, st = decide(snap([*jobs, g0], nodes, needs=[need("g0", "n1")], now=NOW + 30), st, P)
    assert sorted(d.job_id for d in ds if d.kind == "requeue") == ["t0", "t1"]
    pend = [dataclasses.replace(j, state="PENDING", node=None, start_unix=None, restarts=1) for j in jobs[1:]]
    ds, st = decide(snap([jobs[0], g0, *pend], nodes, now=NOW + 31), st, P)
    made = sorted((d for d in ds if d.kind == "make_eligible"), key=lambda d: d.job_id)
    # The whole job was requeued: nothing trains on, so nothing waits a hold.
    assert made == [MakeEligible("t0"), MakeEligible("t1")] and all(d.start_unix is None for d in made)


def test_the_hosts_loss_counts_every_task_in_the_victim_choice():
    """Beside a plain job that lost 150 GPU-seconds, the host (100 s of its own, 100 s of t1's) is the
    dearer victim; alone it would have been the cheaper one."""
    jobs, nodes = _setup()
    plain = job("o9", state="RUNNING", requested="opportunistic", job_class="opportunistic", node="n1",
                start=NOW - 150)
    g0 = job("g0", state="RUNNING", job_class="guaranteed", node="n1")
    nodes[0] = node("n1", (gpu(0, g=("g0",), o=("t0", "o9")),), configured=2, in_slurm=2)
    ds, _ = decide(snap([*jobs, g0, plain], nodes, needs=[need("g0", "n1")]), CoordinatorState.empty(), P)
    assert [d.job_id for d in ds if d.kind == "preempt_notice"] == ["o9"]
    lone_host = dataclasses.replace(jobs[1], elastic_host=True)
    ds, _ = decide(snap([jobs[0], lone_host, g0, plain], nodes, needs=[need("g0", "n1")]),
                   CoordinatorState.empty(), P)
    assert [d.job_id for d in ds if d.kind == "preempt_notice"] == ["t0"]


def _slurm_job(job_id: int, task: str, state: str, per_node: int, elastic=(2, 4), array: int = 500) -> Job:
    tag = JobTag("opportunistic", requested="opportunistic", elastic=elastic).render()
    nodes = ["n1"] if state == "RUNNING" else []
    return Job(job_id, "train", "u", "a", "p", state, "None", ",".join(nodes), nodes, 0, tag, "", "opportunistic",
               {}, f"gres/gpu:{per_node}", None, None, array_job_id=array, array_task=task)


def test_the_snapshot_builder_finds_elastic_arrays_and_their_hosts():
    cfg = cfgmod.parse({"nodes": [{"name": "n1", "gpus": 2}]})
    jobs = [_slurm_job(501, "1", "RUNNING", 2), _slurm_job(500, "2-3%4", "PENDING", 2),
            _slurm_job(502, "0", "RUNNING", 2),
            _slurm_job(600, "0", "RUNNING", 2, elastic=(1, 2), array=600),  # a sweep: each task its own job
            _slurm_job(700, "0", "RUNNING", 2, elastic=None, array=700)]
    s = snapshot_builder.build(cfg, jobs, [], {}, time.time())
    views = {v.job_id: v for v in s.jobs}
    assert {k: (v.elastic_group, v.elastic_host) for k, v in views.items()} == {
        "501": ("500", False), "500": ("500", False), "502": ("500", True), "600": ("", False), "700": ("", False)}


def test_a_job_requeued_again_after_ours_is_left_to_the_keep_off():
    """Requeued by the coordinator, started, refused by its Prolog and requeued again between two
    snapshots: the coordinator's record of its own requeue ends, so it does not shield the job from the
    keep-off's MakeEligible (Slurm's BeginTime wait would otherwise hold it ~121 s)."""
    jobs, nodes = _setup()
    _, st = decide(snap(jobs, nodes, needs=[need("g1", "n2")]), CoordinatorState.empty(), P)
    _, st = decide(snap(jobs, nodes, needs=[need("g1", "n2")], now=NOW + 30), st, P)
    assert "t1" in st.requeued
    again = dataclasses.replace(jobs[2], state="PENDING", node=None, start_unix=None, restarts=2, begin_wait=True)
    ds, st = decide(snap([jobs[0], jobs[1], again], nodes, now=NOW + 40), st, P)
    assert "t1" not in st.requeued
    assert not [d for d in ds if d.kind == "make_eligible" and d.start_unix is not None]


def test_the_keep_off_makes_a_job_requeued_again_eligible():
    jobs, nodes = _setup()
    p = dataclasses.replace(P, keep_off_no_room=True)
    _, st = decide(snap(jobs, nodes, needs=[need("g1", "n2")]), CoordinatorState.empty(), p)
    _, st = decide(snap(jobs, nodes, needs=[need("g1", "n2")], now=NOW + 30), st, p)
    again = dataclasses.replace(jobs[2], state="PENDING", node=None, start_unix=None, restarts=2, begin_wait=True)
    ds, st = decide(snap([jobs[0], jobs[1], again], nodes, now=NOW + 40), st, p)
    keep = [d for d in ds if d.kind == "keep_off"]
    if keep:  # its list first; the next cycle, with the list in place, lifts the wait
        again = dataclasses.replace(again, excluded_nodes=keep[0].nodes)
        ds, st = decide(snap([jobs[0], jobs[1], again], nodes, now=NOW + 41), st, p)
    assert [d for d in ds if d.kind == "make_eligible"] == [MakeEligible("t1")], ds
