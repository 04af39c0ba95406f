"""Tasks of one elastic array across nodes never share a GPU (docs/elastic.md, "Tasks never share a
GPU"), on the pure paths: the node placement rule (``choose_gpus(apart=...)``), the coordinator keeping
the array's pending tasks off nodes where its other tasks leave no GPU with room, and the protocol's
``job_register.elastic_group``."""

from __future__ import annotations

import dataclasses
import json

import pytest

from slurm_antman import protocol as p
from slurm_antman.lab.snapshots import GiB, PARAMS, gpu, job, node, snap
from slurm_antman.policy.cluster import CoordinatorState, KeepOff, MakeEligible, decide
from slurm_antman.policy.node.placement import GpuLoad, choose_gpus

# --- the node placement rule --------------------------------------------------------------------


def _load(i: int, util: float = 0.0, g: int = 0, o: int = 0) -> GpuLoad:
    return GpuLoad(i, 80 * GiB, (20 if g else 0) * GiB, util, g, o)


def _choose(loads, count, **kw):
    return choose_gpus(loads, count, slots_per_gpu=2, threshold=0.8, window_s=10.0, **kw)


def test_a_task_is_not_placed_on_a_gpu_a_sibling_holds():
    # Two idle GPUs: ties go to the highest index, GPU 1; a sibling there sends the task to GPU 0.
    loads = [_load(0), _load(1)]
    assert _choose(loads, 1, wait_without_room=True).gpus == [1]
    placed = _choose(loads, 1, wait_without_room=True, apart={1})
    assert (placed.gpus, placed.placement, placed.note) == ([0], "fit", "")


def test_a_node_whose_every_gpu_holds_a_sibling_is_no_room():
    placed = _choose([_load(0, o=1)], 1, wait_without_room=True, apart={0})
    assert (placed.gpus, placed.placement) == ([], "wait")
    assert "GPU 0: another task of the job's elastic array runs there" in placed.note
    # The same GPU without the sibling rule takes the job (a free slot of two).
    assert _choose([_load(0, o=1)], 1, wait_without_room=True).gpus == [0]


def test_a_task_of_several_gpus_needs_all_of_them_free_of_siblings():
    four = [_load(i) for i in range(4)]
    placed = _choose(four, 2, wait_without_room=True, apart={0})
    assert placed.placement == "fit" and len(placed.gpus) == 2 and 0 not in placed.gpus
    # Three GPUs free of siblings, four asked: never three plus a sibling's.
    placed = _choose(four, 4, wait_without_room=True, apart={0})
    assert (sorted(placed.gpus), placed.placement) == ([1, 2, 3], "wait")
    placed = _choose(four, 2, wait_without_room=True, apart={0, 1, 2})
    assert (placed.gpus, placed.placement) == ([3], "wait")


def test_placement_memory_never_takes_a_siblings_gpu_back():
    # A GPU the task was moved off is taken again when nothing else qualifies, but not one a sibling holds.
    assert _choose([_load(0)], 1, wait_without_room=True, avoid={0}).gpus == [0]
    placed = _choose([_load(0, o=1)], 1, wait_without_room=True, avoid={0}, apart={0})
    assert placed.placement == "wait"
    placed = _choose([_load(0, o=1), _load(1)], 1, wait_without_room=True, avoid={1}, apart={0})
    assert (placed.gpus, placed.placement) == ([1], "fit")


def test_the_fallback_takes_a_siblings_gpu_only_when_no_other_is_left():
    # GPU 0: a busy guaranteed job (no room); GPU 1: idle but a sibling's. The least-loaded would be 1.
    loads = [_load(0, util=0.95, g=1), _load(1, o=1)]
    assert _choose(loads, 1).gpus == [1]
    placed = _choose(loads, 1, apart={1})
    assert (placed.gpus, placed.placement) == ([0], "fallback")
    placed = _choose([_load(0, o=1)], 1, apart={0})
    assert (placed.gpus, placed.placement) == ([0], "fallback")
    assert "another task of the job's elastic array" in placed.note


# --- the coordinator keeps the array's pending tasks off such nodes -----------------------------

WAIT = dataclasses.replace(PARAMS, keep_off_no_room=True)
EMPTY = CoordinatorState.empty()


def _task(job_id: str, group: str = "500", **kw):
    kw.setdefault("requested", "opportunistic")
    return dataclasses.replace(job(job_id, **kw), elastic_group=group)


def _running(job_id: str, node_name: str, group: str = "500", gpus: int = 1):
    return _task(job_id, group, state="RUNNING", node=node_name, gpus=gpus)


def _one_gpu(name: str, *opp: str):
    # One idle GPU, two opportunistic slots: with one job on it, the node has room for another.
    return node(name, (gpu(0, o=opp),), configured=2, in_slurm=2)


def keep_offs(ds):
    return [d for d in ds if d.kind == "keep_off"]


def test_a_refused_task_is_kept_off_its_siblings_node_made_eligible_and_let_back():
    t0 = _running("t0", "n1")
    t1 = _task("t1", restarts=1, begin_wait=True)  # its Prolog on n1 refused it
    nodes = [_one_gpu("n1", "t0"), _one_gpu("n2")]
    ds, st = decide(snap([t0, t1], nodes), EMPTY, WAIT)
    assert keep_offs(ds) == [KeepOff("t1", ("n1",))]
    assert "holds a task of elastic array 500 (n1)" in ds[0].reason and ds[0].inputs["apart"] == ["n1"]
    assert "no GPU meets the opportunistic rules" not in ds[0].reason
    # Slurm shows the list: the requeue's BeginTime wait is lifted, the task starts on n2.
    shown = dataclasses.replace(t1, excluded_nodes=("n1",))
    ds, st = decide(snap([t0, shown], nodes), st, WAIT)
    assert keep_offs(ds) == [] and [d for d in ds if d.kind == "make_eligible"] == [MakeEligible("t1")]
    # The record survives a coordinator restart; once t0 is gone, n1 is the task's again.
    st = CoordinatorState.from_json(json.loads(json.dumps(st.to_json())))
    ds, _ = decide(snap([shown], [_one_gpu("n1"), _one_gpu("n2")]), st, WAIT)
    assert keep_offs(ds) == [KeepOff("t1", ())]


def test_only_the_arrays_own_tasks_are_kept_off():
    nodes = [_one_gpu("n1", "t0"), _one_gpu("n2")]
    jobs = [_running("t0", "n1"), _task("x1", group="600"), job("o1", requested="opportunistic")]
    ds, _ = decide(snap(jobs, nodes), EMPTY, WAIT)
    assert keep_offs(ds) == []
    # and only under no_room: wait, as every exclusion for room
    ds, _ = decide(snap([_running("t0", "n1"), _task("t1")], nodes), EMPTY, PARAMS)
    assert keep_offs(ds) == []


def test_a_task_of_several_gpus_is_kept_off_where_fewer_are_free_of_its_siblings():
    t0 = _running("t0", "n1", gpus=2)
    four = node("n1", tuple(gpu(i, o=("t0",) if i < 2 else ()) for i in range(4)), configured=8, in_slurm=8)
    ds, _ = decide(snap([t0, _task("t1", gpus=2)], [four]), EMPTY, WAIT)
    assert keep_offs(ds) == []  # GPUs 2 and 3 are free of t0
    # A busy guaranteed job on GPU 3: one GPU with room left free of t0, two wanted.
    busy = node("n1", (*four.gpus[:3], gpu(3, util=0.95, used_gib=20, g=("g1",))), configured=8, in_slurm=8)
    ds, _ = decide(snap([t0, _task("t1", gpus=2)], [busy]), EMPTY, WAIT)
    assert keep_offs(ds) == [KeepOff("t1", ("n1",))]


def test_a_sibling_slurm_started_that_the_report_does_not_show_yet_counts():
    nodes = [_one_gpu("n1"), _one_gpu("n2")]
    ds, _ = decide(snap([_running("t0", "n1"), _task("t1")], nodes), EMPTY, WAIT)
    assert keep_offs(ds) == [KeepOff("t1", ("n1",))]
    # A plain job Slurm started there, unreported, keeps no task of the array off n1.
    plain = job("o1", state="RUNNING", requested="opportunistic", node="n1")
    ds, _ = decide(snap([plain, _task("t1")], nodes), EMPTY, WAIT)
    assert keep_offs(ds) == []


# --- the protocol field -------------------------------------------------------------------------


def _register(**kw):
    return p.JobRegister(job_id="45", uid=1000, user="alice", job_class="opportunistic", gpus=1, **kw)


def _sent(body) -> dict:
    return json.loads(p.encode(p.message(body))[1])["body"]


def test_elastic_group_round_trips_and_stays_off_the_wire_while_null():
    back = p.decode(p.encode(p.message(_register(elastic_group="812"))), p.CONTROL_REQUESTS).body
    assert back.elastic_group == "812" and _sent(_register(elastic_group="812"))["elastic_group"] == "812"
    assert "elastic_group" not in _sent(_register())
    assert p.decode(p.encode(p.message(_register()))).body.elastic_group is None


@pytest.mark.parametrize("bad, code", [("81a", p.ErrorCode.bad_value), ("", p.ErrorCode.bad_value),
                                       ("12345678901", p.ErrorCode.bad_value),
                                       (812, p.ErrorCode.bad_type)])
def test_a_bad_elastic_group_is_refused_by_name(bad, code):
    frames = p.encode(p.message(_register()))
    env = json.loads(frames[1])
    env["body"]["elastic_group"] = bad
    with pytest.raises(p.ProtocolError) as e:
        p.decode([frames[0], json.dumps(env).encode()], p.CONTROL_REQUESTS)
    assert e.value.code == code and "job_register.elastic_group" in e.value.message
    with pytest.raises(p.ProtocolError):
        p.encode(p.message(_register(elastic_group=bad)))  # a sender's bug fails at the sender


def test_a_job_id_or_node_name_with_a_final_newline_is_refused():
    """``$`` matched before a final newline: "7\\n" passed as a job id (a socket directory's name)."""
    for mtype, body, name in [("job_retire", {"job_id": "7\n"}, "job_retire.job_id"),
                              ("job_register", {**p.body_dict(_register()), "elastic_group": "7\n"},
                               "job_register.elastic_group")]:
        env = {"v": p.PROTOCOL_VERSION, "type": mtype, "id": "x", "ts": 1.0, "ref": None, "body": body}
        with pytest.raises(p.ProtocolError) as e:
            p.decode([p.MARKER, json.dumps(env).encode()], p.CONTROL_REQUESTS)
        assert e.value.code == p.ErrorCode.bad_value and name in e.value.message
    assert not p.NODE_NAME_RE.match("n1\n") and p.NODE_NAME_RE.match("n1")
