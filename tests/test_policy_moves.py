"""Moving crawling opportunistic jobs (policy.moves) and the progress prediction behind placement
(policy.progress), on hand-built snapshots through the whole policy core."""

from __future__ import annotations

import dataclasses
import json

import pytest

from slurm_antman.policy.cluster import CoordinatorState, PreemptNotice, Requeue, decide
from slurm_antman.lab.snapshots import NOW, PARAMS, gpu, job, node, snap
from slurm_antman.policy.cluster.placement import gpu_qualifies, node_slots
from slurm_antman.policy.progress import predicted_progress

EMPTY = CoordinatorState.empty()
WAIT = PARAMS.move_after_s


def crawler(since: float, progress: float = 0.05, job_id: str = "7"):
    """GPU 0 of n1: a busy guaranteed job and opportunistic job ``job_id`` crawling since ``since``."""
    return gpu(0, util=0.6, g=("1",), o=(job_id,), progress={job_id: progress}, crawling={job_id: since})


def jobs(*opp_ids: str):
    return [job("1", state="RUNNING", job_class="guaranteed")] + [
        job(j, state="RUNNING", requested="opportunistic", start=NOW - 5000) for j in opp_ids]


def moves(ds):
    return [d for d in ds if d.kind == "preempt_notice"]


def test_prediction_idle_beats_shared_beats_beside_guaranteed():
    assert predicted_progress(0.0, 0, 0, 0.02) == 1.0
    assert predicted_progress(0.5, 0, 1, 0.02) == pytest.approx(1 / 1.5)
    # The 2 % target beside a guaranteed job keeping the GPU 50 % busy leaves a 4 % share ...
    assert predicted_progress(0.5, 1, 0, 0.02) == pytest.approx(0.04)
    # ... split with the opportunistic job already there; a nearly idle guaranteed job leaves all.
    assert predicted_progress(0.5, 1, 1, 0.02) == pytest.approx(0.02)
    assert predicted_progress(0.005, 1, 0, 0.02) == 1.0


def test_gpu_beside_a_busy_guaranteed_job_takes_no_opportunistic_slot():
    busy = gpu(0, util=0.5, g=("1",))
    quiet = gpu(1, util=0.01, g=("2",))
    assert not gpu_qualifies(busy, PARAMS) and gpu_qualifies(quiet, PARAMS)
    total, inputs = node_slots(node(gpus=(busy, quiet, gpu(2), gpu(3))), PARAMS, 0, ())
    assert inputs["gpus_qualifying"] == 3 and total == 6


def test_crawler_is_moved_to_the_best_gpu_after_move_after_s():
    nodes = [node("n1", (crawler(NOW - WAIT - 1), gpu(1, util=0.4, o=("8",)))),
             node("n2", (gpu(0, util=0.3, g=("2",)), gpu(1)))]
    ds, st = decide(snap(jobs("7", "8"), nodes), EMPTY, PARAMS)
    notice = moves(ds)
    assert notice == [PreemptNotice("7", "n1", PARAMS.grace_s)]
    assert notice[0].inputs["targets"] == [["n2", 1, 1.0]] and notice[0].inputs["move"]
    assert notice[0].reason.startswith("moved: progress 0.05") and "n2 GPU 1 (1.00)" in notice[0].reason
    assert st.avoid["7"].node == "n1" and st.avoid["7"].gpu == 0
    # The grace time later the preemption path requeues it, once.
    later = dataclasses.replace(snap(jobs("7", "8"), nodes), now=NOW + PARAMS.grace_s)
    ds2, st2 = decide(later, st, PARAMS)
    assert Requeue("7") in ds2 and not moves(ds2)
    assert "7" in st2.avoid  # placement memory outlives the requeue


def test_the_rendezvous_host_of_an_elastic_array_moves_with_its_array_other_tasks_alone():
    nodes = [node("n1", (crawler(NOW - WAIT - 1), gpu(1, util=0.4, o=("8",)))),
             node("n2", (gpu(0, util=0.3, g=("2",)), gpu(1)))]
    host = [dataclasses.replace(j, elastic_group="7", elastic_host=j.job_id == "7") for j in jobs("7", "8")]
    ds, st = decide(snap(host, nodes), EMPTY, PARAMS)
    assert moves(ds) == [PreemptNotice("7", "n1", PARAMS.grace_s), PreemptNotice("8", "n1", PARAMS.grace_s)]
    assert "rendezvous host 7 is moved" in moves(ds)[1].reason and set(st.preempting) == {"7", "8"}
    task = [dataclasses.replace(j, elastic_group="6" if j.job_id == "7" else "") for j in jobs("7", "8")]
    ds, _ = decide(snap(task, nodes), EMPTY, PARAMS)
    assert moves(ds) == [PreemptNotice("7", "n1", PARAMS.grace_s)]


def test_not_moved_before_move_after_s_nor_without_a_better_gpu():
    nodes = [node("n1", (crawler(NOW - WAIT + 5), gpu(1)))]
    assert not moves(decide(snap(jobs("7"), nodes), EMPTY, PARAMS)[0])
    # Due, but the only other GPU promises 0.04 (< max(min_progress, 2 x 0.05)).
    nodes = [node("n1", (crawler(NOW - WAIT - 1), gpu(1, util=0.5, g=("2",))))]
    assert not moves(decide(snap(jobs("7"), nodes), EMPTY, PARAMS)[0])
    # A GPU at 0.5 opportunistic load promises 0.67 < 2 x 0.4: not worth a restart.
    nodes = [node("n1", (crawler(NOW - WAIT - 1, progress=0.4), gpu(1, util=0.5, o=("9",))))]
    assert not moves(decide(snap(jobs("7", "9"), nodes), EMPTY, PARAMS)[0])
    # Moves switched off.
    nodes = [node("n1", (crawler(NOW - WAIT - 1), gpu(1)))]
    off = dataclasses.replace(PARAMS, move_after_s=None)
    assert not moves(decide(snap(jobs("7"), nodes), EMPTY, off)[0])


def test_two_crawlers_do_not_take_the_same_free_gpu():
    g0 = gpu(0, util=0.6, g=("1",), o=("7", "8"), progress={"7": 0.02, "8": 0.02},
             crawling={"7": NOW - WAIT - 9, "8": NOW - WAIT - 1})
    busy = (gpu(1, util=0.9, g=("2",)), gpu(2, util=0.9, g=("3",)))
    # One free GPU: it takes one moved job per cycle (what it promises changes once one is there),
    # the one that has crawled longer.
    ds, _ = decide(snap(jobs("7", "8"), [node("n1", (g0,) + busy + (gpu(3),))]), EMPTY, PARAMS)
    assert [(d.job_id, d.inputs["targets"]) for d in moves(ds)] == [("7", [["n1", 3, 1.0]])]
    # Two free GPUs: both move, each to its own.
    ds, _ = decide(snap(jobs("7", "8"), [node("n1", (g0,) + busy + (gpu(3),)), node("n2", (gpu(0),))]),
                   EMPTY, PARAMS)
    assert sorted((d.job_id, d.inputs["targets"][0][0]) for d in moves(ds)) == [("7", "n1"), ("8", "n2")]


def test_a_job_under_notice_or_not_opportunistic_is_not_moved():
    nodes = [node("n1", (crawler(NOW - WAIT - 1), gpu(1)))]
    upgraded = [job("1", state="RUNNING", job_class="guaranteed"),
                job("7", state="RUNNING", requested="opportunistic", job_class="guaranteed")]
    assert not moves(decide(snap(upgraded, nodes), EMPTY, PARAMS)[0])
    _, st = decide(snap(jobs("7"), nodes), EMPTY, PARAMS)
    again = dataclasses.replace(snap(jobs("7"), nodes), now=NOW + 1)
    assert not moves(decide(again, st, PARAMS)[0])  # one notice per crawl


def test_placement_memory_survives_a_restart_of_the_coordinator():
    nodes = [node("n1", (crawler(NOW - WAIT - 1), gpu(1)))]
    _, st = decide(snap(jobs("7"), nodes), EMPTY, PARAMS)
    back = CoordinatorState.from_json(json.loads(json.dumps(st.to_json())))
    assert back.avoid == st.avoid and back.preempting == st.preempting
    # Forgotten once the job is gone from Slurm's view.
    _, st2 = decide(snap([job("1", state="RUNNING", job_class="guaranteed")], nodes), back, PARAMS)
    assert "7" not in st2.avoid


def test_a_job_preempted_for_a_need_is_remembered_off_that_gpu():
    from slurm_antman.lab.snapshots import need
    nodes = [node("n1", (gpu(0, util=0.6, g=("1",), o=("7",)), gpu(1)))]
    ds, st = decide(snap(jobs("7"), nodes, needs=(need("1", "n1", 0),)), EMPTY, PARAMS)
    assert [d.job_id for d in moves(ds)] == ["7"] and not ds[0].inputs.get("move")
    assert (st.avoid["7"].node, st.avoid["7"].gpu) == ("n1", 0)


def test_explain_tells_a_move_from_a_preemption(tmp_path):
    from slurm_antman.coordinator import audit
    from slurm_antman.coordinator.explain import explain
    nodes = [node("n1", (crawler(NOW - WAIT - 1), gpu(1)))]
    ds, _ = decide(snap(jobs("7"), nodes), EMPTY, PARAMS)
    log = audit.AuditLog(tmp_path / "audit.jsonl")
    for d in ds:
        log.append(audit.decision_record(d, "ok", NOW))
    log.close()
    text, rc = explain("7", str(tmp_path / "audit.jsonl"))
    assert rc == 0 and "move notice (crawling) (grace 30 s) on n1" in text
    assert "why: moved: progress 0.05 of its solo rate on n1 GPU 0" in text


def test_sidecar_report_carries_progress_and_crawling_into_the_snapshot():
    from slurm_antman import config, protocol as p
    from slurm_antman.coordinator.hub import HeardReport
    from slurm_antman.coordinator.snapshot_builder import node_views
    cfg = config.parse({"nodes": [{"name": "n1", "gpus": 2}]})
    gpus = [p.ReportGpu(index=0, mem_total_bytes=80 << 30, mem_used_bytes=0, util=0.6, jobs=["1", "7"]),
            p.ReportGpu(index=1, mem_total_bytes=80 << 30, mem_used_bytes=0, util=0.0, jobs=[])]
    reported = [p.ReportJob(job_id="1", job_class="guaranteed", gpus=[0], mem_limit_bytes=None, mem_used_bytes=None,
                            compute_share=1.0, iteration_ms=100.0, last_checkpoint_unix=None),
                p.ReportJob(job_id="7", job_class="opportunistic", gpus=[0], mem_limit_bytes=None, mem_used_bytes=None,
                            compute_share=0.05, iteration_ms=2000.0, last_checkpoint_unix=None,
                            progress=0.05, crawling_since_unix=NOW - 700)]
    body = p.NodeReport(node="n1", telemetry="nvml", gpus=gpus, jobs=reported, preempt_requests=[])
    # Encoded and decoded as the uplink does: the optional fields survive.
    body = p.decode(p.encode(p.message(body))).body
    views = node_views(cfg, [], {"n1": HeardReport("n1", NOW, body)}, {"1": "guaranteed", "7": "opportunistic"}, NOW)
    g0 = views[0].gpus[0]
    assert g0.opportunistic_jobs == ("7",) and g0.progress == (("7", 0.05),) and g0.crawling == (("7", NOW - 700),)
    assert views[0].unhealthy == ""  # healthy
    sick = p.decode(p.encode(p.message(dataclasses.replace(body, unhealthy="/run/x is full")))).body
    assert node_views(cfg, [], {"n1": HeardReport("n1", NOW, sick)}, {}, NOW)[0].unhealthy == "/run/x is full"
    ds, _ = decide(snap(jobs("7"), views), EMPTY, PARAMS)
    assert [d.job_id for d in moves(ds)] == ["7"]
