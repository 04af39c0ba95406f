"""Checkpoints for the tasks of an elastic array that stay when a sibling leaves or joins (docs/elastic.md,
"Across nodes: a job array"): the coordinator's core asks for them, the sidecar relays them to the agents
that named the ``checkpoint`` feature, and the agent runs the job's hooks two iterations ahead of the
moment asked for and trains on. The whole path on the devcluster is tests/test_cluster_elastic_array.py."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest
import torch

import torch_patch
from slurm_antman import protocol as P
from slurm_antman.lab.snapshots import NOW, PARAMS, gpu, job, need, node, snap
from slurm_antman.policy.cluster import CheckpointNotice, CoordinatorState, PreemptNotice, decide
from slurm_antman.policy.cluster.array_checkpoint import JOIN_WINDOW_S
from torch_patch.agent import Agent
from torch_patch.checkpoint import LEAD_ITERATIONS, CheckpointHooks
from torch_patch.client import CheckpointRequest



# --- the core ----------------------------------------------------------------------------------------


def _task(job_id: str, node_name: str, host: bool, group: str = "500", start: float = NOW - 100, **kw):
    v = job(job_id, state="RUNNING", requested="opportunistic", job_class="opportunistic", node=node_name,
            start=start, **kw)
    return dataclasses.replace(v, elastic_group=group, elastic_host=host)


def _three_tasks():
    """Array 500: host t0 on n1, t1 on n2 beside guaranteed g1, t2 on n3; o9 (a plain job) on n3 too."""
    t0, t1, t2 = _task("t0", "n1", True), _task("t1", "n2", False), _task("t2", "n3", False)
    o9 = job("o9", state="RUNNING", requested="opportunistic", job_class="opportunistic", node="n3", start=NOW - 100)
    g1 = job("g1", state="RUNNING", job_class="guaranteed", node="n2")
    nodes = [node("n1", (gpu(0, o=("t0",)),), configured=2, in_slurm=1),
             node("n2", (gpu(0, g=("g1",), o=("t1",)),), configured=2, in_slurm=1),
             node("n3", (gpu(0, o=("t2",)), gpu(1, o=("o9",))), configured=2, in_slurm=2)]
    return [g1, t0, t1, t2, o9], nodes


def test_a_shed_task_asks_every_task_of_its_array_to_checkpoint_at_its_requeue():
    jobs, nodes = _three_tasks()
    ds, st = decide(snap(jobs, nodes, needs=[need("g1", "n2")]), CoordinatorState.empty(), PARAMS)
    assert [d for d in ds if d.kind == "preempt_notice"] == [PreemptNotice("t1", "n2", PARAMS.grace_s)]
    asked = [d for d in ds if d.kind == "checkpoint_notice"]
    # Every task at the moment of the requeue, the leaving one too (rank 0, the one that saves, may be
    # there); nobody else (o9 is not of the array).
    assert asked == [CheckpointNotice("t0", "n1", PARAMS.grace_s, "leave:t1"),
                     CheckpointNotice("t1", "n2", PARAMS.grace_s, "leave:t1"),
                     CheckpointNotice("t2", "n3", PARAMS.grace_s, "leave:t1")]
    assert "task t1 of elastic array 500 is requeued" in asked[0].reason
    # Not asked again in the next cycles of the grace time, nor at the requeue.
    for t in (NOW + 1, NOW + PARAMS.grace_s):
        ds, st = decide(snap(jobs, nodes, needs=[need("g1", "n2")], now=t), st, PARAMS)
        assert not [d for d in ds if d.kind == "checkpoint_notice"], ds


def test_the_hosts_loss_asks_every_task_for_the_moment_the_whole_array_is_requeued():
    jobs, nodes = _three_tasks()
    g0 = job("g0", state="RUNNING", job_class="guaranteed", node="n1")
    nodes[0] = node("n1", (gpu(0, g=("g0",), o=("t0",)),), configured=2, in_slurm=1)
    ds, _ = decide(snap([*jobs, g0], nodes, needs=[need("g0", "n1")]), CoordinatorState.empty(), PARAMS)
    assert {d.job_id for d in ds if d.kind == "preempt_notice"} == {"t0", "t1", "t2"}
    assert [(d.job_id, d.at_s, d.cause) for d in ds if d.kind == "checkpoint_notice"] == [
        ("t0", PARAMS.grace_s, "leave:t0"), ("t1", PARAMS.grace_s, "leave:t0"), ("t2", PARAMS.grace_s, "leave:t0")]


def test_a_task_that_joins_asks_the_running_ones_to_checkpoint_at_once_and_once():
    jobs, nodes = _three_tasks()
    joined = dataclasses.replace(jobs[2], start_unix=NOW - 2, restarts=1)  # t1 started again 2 s ago
    jobs = [jobs[0], jobs[1], joined, jobs[3], jobs[4]]
    ds, st = decide(snap(jobs, nodes), CoordinatorState.empty(), PARAMS)
    asked = [d for d in ds if d.kind == "checkpoint_notice"]
    assert asked == [CheckpointNotice("t0", "n1", 0.0, "join:t1:1"), CheckpointNotice("t2", "n3", 0.0, "join:t1:1")]
    assert "started" in asked[0].reason
    ds, st = decide(snap(jobs, nodes, now=NOW + 1), st, PARAMS)
    assert not [d for d in ds if d.kind == "checkpoint_notice"], "sent once per start"
    # If delivering failed, the daemon forgets the decision and the next cycle asks again.
    st = st.forget(asked[0])
    ds, st = decide(snap(jobs, nodes, now=NOW + 2), st, PARAMS)
    assert [d for d in ds if d.kind == "checkpoint_notice"] == [asked[0]]
    # Past the window the start is no join any more: a coordinator that starts late asks nothing.
    ds, _ = decide(snap(jobs, nodes, now=NOW - 2 + JOIN_WINDOW_S + 1), CoordinatorState.empty(), PARAMS)
    assert not [d for d in ds if d.kind == "checkpoint_notice"]


def test_tasks_that_start_together_ask_nothing_of_each_other():
    jobs, nodes = _three_tasks()
    jobs = [jobs[0]] + [dataclasses.replace(j, start_unix=NOW - 1) for j in jobs[1:4]] + [jobs[4]]
    ds, _ = decide(snap(jobs, nodes), CoordinatorState.empty(), PARAMS)
    assert not [d for d in ds if d.kind == "checkpoint_notice"]


# --- the agent's timing ------------------------------------------------------------------------------


def test_a_request_is_due_two_iterations_ahead_and_a_newer_one_replaces_an_older():
    h = CheckpointHooks()
    h.request_arrived(CheckpointRequest(1, at_unix=100.0, reason="r", ref=None))
    assert h.request_due(100.0 - LEAD_ITERATIONS * 0.5 - 0.01, 0.5) is None
    h.request_arrived(CheckpointRequest(2, at_unix=200.0, reason="later", ref=None))
    h.request_arrived(CheckpointRequest(1, at_unix=50.0, reason="stale", ref=None))  # an older seq: ignored
    assert h.request_due(150.0, 0.5) is None
    req = h.request_due(200.0 - LEAD_ITERATIONS * 0.5, 0.5)
    assert req is not None and req.seq == 2 and req.reason == "later"
    assert h.request_due(300.0, 0.5) is None, "taken once"


def _job():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 8), torch.randn(16, 1)

    def iteration() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        time.sleep(0.02)

    return iteration


@pytest.fixture
def peer(agent_peer):
    return agent_peer


@pytest.fixture(autouse=True)
def _clean():
    torch_patch.uninstall()
    yield


def test_the_agent_checkpoints_in_the_training_thread_near_the_moment_and_trains_on(peer):
    agent = Agent(job_id="42", job_class="opportunistic", endpoint=peer.endpoint, use_cuda=False).start()
    calls: list = []
    agent.on_preempt(lambda n: calls.append((n, threading.current_thread() is trainer, time.time(), agent.iteration)))
    it = _job()
    stop = threading.Event()
    trainer = threading.Thread(target=lambda: [it() for _ in iter(stop.is_set, True)], daemon=True)
    try:
        reg = peer.wait_type("register").msg.body
        assert P.FEATURE_CHECKPOINT in reg.features
        trainer.start()
        peer.wait_type("report")
        at = time.time() + 1.0
        mid = peer.send_body(P.Checkpoint(seq=1, at_unix=at, reason="task 7 of elastic array 5 leaves"))
        done = peer.wait_type("checkpoint_done", timeout=10).msg
        assert done.ref == mid and done.body.seq == 1
        assert len(calls) == 1
        notice, in_trainer, t, _ = calls[0]
        assert in_trainer and notice.kind == "checkpoint" and notice.width is None
        assert notice.deadline_unix == at and "elastic array 5" in notice.reason
        # Not at arrival, a second early: two iterations (~25 ms each here) ahead, give or take one.
        assert at - 0.5 < t <= at + 0.2, (t - at)
        assert -500.0 < done.body.late_ms <= 200.0
        assert agent.hooks.done == [(1, done.body.checkpoint_ms, done.body.late_ms)]
        n = agent.iteration
        deadline = time.monotonic() + 5
        while agent.iteration < n + 10 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert agent.iteration >= n + 10, "the job trains on after the checkpoint"
        # A repeated seq: nothing; a moment already past: at the next boundary.
        peer.send_body(P.Checkpoint(seq=1, at_unix=time.time(), reason="again"))
        peer.send_body(P.Checkpoint(seq=2, at_unix=time.time() - 5, reason="task 8 joined"))
        peer.wait_type("checkpoint_done", where=lambda b: b.seq == 2)
        assert [c[0].reason for c in calls] == ["task 7 of elastic array 5 leaves", "task 8 joined"]
        assert not [r for r in peer.received if r.error is not None]
    finally:
        stop.set()
        trainer.join(5)
        agent.stop()


def _raw(mtype: str, body: dict) -> list[bytes]:
    env = {"v": P.PROTOCOL_VERSION, "type": mtype, "id": "m-1", "ts": 1.0, "ref": None, "body": body}
    return [P.MARKER, json.dumps(env).encode()]


def test_checkpoint_messages_are_checked_field_by_field():
    with pytest.raises(P.ProtocolError) as e:
        P.decode(_raw("checkpoint_notice", {"job_id": "7", "at_s": 90000.0, "reason": "x"}), P.COORDINATOR_TO_SIDECAR)
    assert e.value.code == P.ErrorCode.bad_value and "checkpoint_notice.at_s" in e.value.message
    with pytest.raises(P.ProtocolError) as e:
        P.decode(_raw("checkpoint", {"seq": 0, "at_unix": 1.0, "reason": ""}), P.SIDECAR_TO_AGENT)
    assert "checkpoint.seq" in e.value.message
    with pytest.raises(P.ProtocolError) as e:
        P.decode(_raw("checkpoint_done", {"seq": 1, "checkpoint_ms": -1.0, "late_ms": 0.0}), P.AGENT_TO_SIDECAR)
    assert "checkpoint_done.checkpoint_ms" in e.value.message
    # An agent may not send a checkpoint request.
    with pytest.raises(P.ProtocolError) as e:
        P.decode(_raw("checkpoint", {"seq": 1, "at_unix": 1.0, "reason": ""}), P.AGENT_TO_SIDECAR)
    assert e.value.code == P.ErrorCode.wrong_direction
