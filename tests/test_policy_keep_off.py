"""opportunistic.no_room: wait in the coordinator: pending opportunistic jobs are kept off (ExcNodeList)
the nodes where no GPU meeting the opportunistic rules has a free slot, and let back as those nodes gain
room. Slurm's count of slots there stays slurm.conf's (policy.cluster.placement says why)."""

from __future__ import annotations

import dataclasses
import json

from slurm_antman.policy.cluster import CoordinatorState, KeepOff, decide
from slurm_antman.lab.snapshots import PARAMS, gpu, job, node, snap

WAIT = dataclasses.replace(PARAMS, keep_off_no_room=True)
EMPTY = CoordinatorState.empty()


def busy_node(name: str) -> object:
    # One GPU, a guaranteed job keeping it 95 % busy: no GPU qualifies; Slurm has both its slots free.
    return node(name, (gpu(0, util=0.95, used_gib=20, g=(f"g-{name}",)),), configured=2, in_slurm=2)


def idle_node(name: str) -> object:
    return node(name, (gpu(0),), configured=2, in_slurm=2)


def keep_offs(ds):
    return [d for d in ds if d.kind == "keep_off"]


def test_pending_opportunistic_job_is_kept_off_nodes_without_room_and_let_back():
    o = job("7", requested="opportunistic")
    ds, st = decide(snap([o], [busy_node("n1"), idle_node("n2")]), EMPTY, WAIT)
    assert keep_offs(ds) == [KeepOff("7", ("n1",))]
    assert "n1" in ds[-1].reason and "no GPU meets the opportunistic rules" in ds[-1].reason
    # Slurm shows the list: nothing more to do.
    shown = job("7", requested="opportunistic", excluded=("n1",))
    ds, st = decide(snap([shown], [busy_node("n1"), idle_node("n2")]), st, WAIT)
    assert keep_offs(ds) == []
    # n1's guaranteed job ended: the job may go there again.
    ds, st = decide(snap([shown], [idle_node("n1"), idle_node("n2")]), st, WAIT)
    assert keep_offs(ds) == [KeepOff("7", ())]
    assert "room again" in keep_offs(ds)[0].reason


def test_what_the_user_excluded_stays_excluded():
    o = job("7", requested="opportunistic", excluded=("n3",))
    nodes = [busy_node("n1"), idle_node("n2"), idle_node("n3")]
    ds, st = decide(snap([o], nodes), EMPTY, WAIT)
    assert keep_offs(ds) == [KeepOff("7", ("n1", "n3"))]
    # The record survives a coordinator restart (state file) and keeps n3 when n1 gains room.
    st = CoordinatorState.from_json(json.loads(json.dumps(st.to_json())))
    assert st.kept_off["7"].added == ("n1",)
    ds, _ = decide(snap([job("7", requested="opportunistic", excluded=("n1", "n3"))],
                        [idle_node("n1"), idle_node("n2"), idle_node("n3")]), st, WAIT)
    assert keep_offs(ds) == [KeepOff("7", ("n3",))]


def test_a_later_edit_of_the_users_list_is_kept():
    o = job("7", requested="opportunistic")
    nodes = [busy_node("n1"), idle_node("n2"), idle_node("n3")]
    _, st = decide(snap([o], nodes), EMPTY, WAIT)
    # The user (scontrol update) excludes n3 too, after the core excluded n1.
    ds, st = decide(snap([job("7", requested="opportunistic", excluded=("n1", "n3"))], nodes), st, WAIT)
    assert keep_offs(ds) == []
    ds, _ = decide(snap([job("7", requested="opportunistic", excluded=("n1", "n3"))],
                        [idle_node("n1"), idle_node("n2"), idle_node("n3")]), st, WAIT)
    assert keep_offs(ds) == [KeepOff("7", ("n3",))]


def test_only_pending_opportunistic_jobs_and_only_when_asked():
    jobs = [job("1", requested="guaranteed"), job("2", state="RUNNING", requested="opportunistic", node="n2"),
            job("3", requested="none")]
    nodes = [busy_node("n1"), idle_node("n2")]
    ds, _ = decide(snap(jobs, nodes), EMPTY, WAIT)
    assert keep_offs(ds) == []
    ds, _ = decide(snap([job("7", requested="opportunistic")], nodes), EMPTY, PARAMS)  # no_room: fallback
    assert keep_offs(ds) == []


def test_a_node_with_a_job_allocated_and_no_free_slot_is_kept_off_too():
    # Slurm still has a free slot there (its count stays slurm.conf's): only the exclusion keeps job 7 off.
    full = node("n1", (gpu(0, util=0.95, g=("g",), o=("5",)),), configured=2, in_slurm=2)
    running = job("5", state="RUNNING", requested="opportunistic", node="n1")
    ds, _ = decide(snap([running, job("7", requested="opportunistic")], [full, idle_node("n2")]), EMPTY, WAIT)
    assert keep_offs(ds) == [KeepOff("7", ("n1",))]
    assert not any(d.kind == "set_opp_slots" for d in ds)


def test_keep_off_and_a_class_decision_for_the_same_job_are_both_issued():
    # An auto job resolved to opportunistic in this cycle: its class and its exclusions are separate keys.
    o = job("7", requested="auto", job_class="opportunistic", submit=1)
    ds, _ = decide(snap([job("1", state="RUNNING", job_class="guaranteed"), o], [busy_node("n1"), idle_node("n2")],
                        quotas={"a": 1}), EMPTY, WAIT)
    assert KeepOff("7", ("n1",)) in ds


def test_a_requeued_job_is_kept_off_before_it_is_made_eligible():
    """The coordinator's own requeue: KeepOff comes before MakeEligible in the same cycle, so Slurm never
    restarts the job on the node without room."""
    from slurm_antman.policy.cluster.model import Requeued

    st = dataclasses.replace(EMPTY, requeued={"7": Requeued("7", "n1", 0, "g-n1", 9_000.0, 0)})
    o = job("7", requested="opportunistic", restarts=1, begin_wait=True)
    ds, _ = decide(snap([o], [busy_node("n1"), idle_node("n2")]), st, WAIT)
    kinds = [(d.kind, d.job_id) for d in ds if getattr(d, "job_id", None) == "7"]
    assert kinds == [("keep_off", "7"), ("make_eligible", "7")], ds


def test_a_job_its_prolog_requeued_is_made_eligible_once_kept_off():
    nodes = [busy_node("n1"), idle_node("n2")]
    waiting = job("7", requested="opportunistic", restarts=1, begin_wait=True)
    ds, st = decide(snap([waiting], nodes), EMPTY, WAIT)
    assert [d.kind for d in ds if getattr(d, "job_id", None) == "7"] == ["keep_off"]
    shown = job("7", requested="opportunistic", restarts=1, begin_wait=True, excluded=("n1",))
    ds, st = decide(snap([shown], nodes), st, WAIT)
    assert [d.kind for d in ds if getattr(d, "job_id", None) == "7"] == ["make_eligible"]
    assert "Prolog" in ds[-1].reason
    # A job that was never requeued has no BeginTime wait to lift.
    ds, _ = decide(snap([job("8", requested="opportunistic", excluded=("n1",))], nodes), EMPTY, WAIT)
    assert [d for d in ds if getattr(d, "job_id", None) == "8"] == []


def test_a_node_that_takes_no_opportunistic_job_is_named_with_its_sidecars_reason():
    """An idle node whose sidecar reports it unhealthy (a failed device grant, a full state directory) has no
    room; the job is kept off it, and the reason `antman explain` shows says why, not only that."""
    sick = node("n1", (gpu(0),), configured=2, in_slurm=1, unhealthy="job 5's GPU could not be granted here (BPF refused)")
    ds, _ = decide(snap([job("7", requested="opportunistic")], [sick, idle_node("n2")]), EMPTY, WAIT)
    [k] = keep_offs(ds)
    assert k == KeepOff("7", ("n1",))
    assert "n1 takes no opportunistic job: job 5's GPU could not be granted here (BPF refused)" in k.reason
    assert k.inputs["unhealthy"] == {"n1": "job 5's GPU could not be granted here (BPF refused)"}
    # A node merely without room says nothing of health.
    ds, _ = decide(snap([job("8", requested="opportunistic")], [busy_node("n1"), idle_node("n2")]), EMPTY, WAIT)
    assert "takes no opportunistic job" not in keep_offs(ds)[0].reason and "unhealthy" not in keep_offs(ds)[0].inputs
