"""The uplink's message types: round trips, validation, and which receivers take them."""

from __future__ import annotations

import json

import pytest

from slurm_antman import protocol as p


def node_report(**kw) -> p.NodeReport:
    base = dict(
        node="gpu-01", telemetry="emulated",
        gpus=[p.ReportGpu(index=0, mem_total_bytes=80 << 30, mem_used_bytes=3 << 30, util=0.25, jobs=["7", "8"])],
        jobs=[p.ReportJob(job_id="7", job_class="guaranteed", gpus=[0], mem_limit_bytes=None, mem_used_bytes=None,
                          compute_share=1.0, iteration_ms=None, last_checkpoint_unix=None),
              p.ReportJob(job_id="8", job_class="opportunistic", gpus=[0], mem_limit_bytes=4 << 30,
                          mem_used_bytes=1 << 30, compute_share=0.3, iteration_ms=51.5, last_checkpoint_unix=1.7e9)],
        preempt_requests=[p.ReportPreemptRequest(job_id="8", gpu=0, reason="GPU 0 full", since_unix=1.7e9)])
    base.update(kw)
    return p.NodeReport(**base)


UPLINK_SAMPLES = [
    node_report(),
    node_report(gpus=[], jobs=[], preempt_requests=[], telemetry="nvml"),
    p.NodeReportAck(node="gpu-01", received_unix=1.7e9),
    p.JobClassUpdate(job_id="8", job_class="guaranteed"),
    p.PreemptNotice(job_id="8", grace_s=30.0, reason="guaranteed job 7 needs GPU 0's memory"),
    p.PreemptNotice(job_id="8", grace_s=30.0, reason="moved: crawling", avoid_gpus=[3]),
    p.CheckpointNotice(job_id="9", at_s=27.0, reason="task 10 of elastic array 9 leaves"),
]


@pytest.mark.parametrize("body", UPLINK_SAMPLES, ids=lambda b: type(b).TYPE)
def test_round_trip(body):
    msg = p.message(body, ref="r-1")
    back = p.decode(p.encode(msg))
    assert back.body == body and back.ref == "r-1" and back.type == type(body).TYPE


def test_new_types_are_registered_with_their_directions():
    new = {"node_report", "node_report_ack", "job_class_update", "preempt_notice"}
    assert new <= set(p.BODY_TYPES)
    assert "node_report" in p.SIDECAR_TO_COORDINATOR
    assert {"node_report_ack", "job_class_update", "preempt_notice"} <= p.COORDINATOR_TO_SIDECAR
    # Agents and control clients never take uplink types.
    assert not new & (p.AGENT_TO_SIDECAR | p.SIDECAR_TO_AGENT | p.CONTROL_REQUESTS | p.CONTROL_REPLIES)


def _wire(body) -> dict:
    return json.loads(p.encode(p.message(body))[1])


def _decode(env: dict, accept=None):
    return p.decode([p.MARKER, json.dumps(env).encode()], accept)


@pytest.mark.parametrize("mutate, code, text", [
    (lambda b: b.update(node="../n1"), "bad_value", "node_report.node"),
    (lambda b: b["gpus"][0].update(util=1.5), "bad_value", "node_report.gpus[0].util"),
    (lambda b: b["gpus"][0].update(jobs=["7", "x"]), "bad_value", "node_report.gpus[0].jobs[1]"),
    (lambda b: b["jobs"][0].update(job_class="auto"), "bad_value", "allowed: guaranteed, opportunistic"),
    (lambda b: b["jobs"][1].update(gpus=[-1]), "bad_value", "node_report.jobs[1].gpus[0]"),
    (lambda b: b["jobs"][1].pop("last_checkpoint_unix"), "missing_field", "last_checkpoint_unix"),
    (lambda b: b["preempt_requests"][0].update(extra=1), "extra_field", "extra"),
    (lambda b: b.update(telemetry="fake"), "bad_value", "telemetry"),
])
def test_bad_reports_name_the_field(mutate, code, text):
    env = _wire(node_report())
    mutate(env["body"])
    with pytest.raises(p.ProtocolError) as ei:
        _decode(env, p.SIDECAR_TO_COORDINATOR)
    assert ei.value.code.value == code and text in ei.value.message


def test_directions_are_enforced():
    with pytest.raises(p.ProtocolError) as ei:
        _decode(_wire(p.PreemptNotice(job_id="1", grace_s=1, reason="r")), p.SIDECAR_TO_COORDINATOR)
    assert ei.value.code is p.ErrorCode.wrong_direction
    for accept in (p.AGENT_TO_SIDECAR, p.CONTROL_REQUESTS, p.COORDINATOR_TO_SIDECAR):
        with pytest.raises(p.ProtocolError) as ei:
            _decode(_wire(node_report()), accept)
        assert ei.value.code is p.ErrorCode.wrong_direction
    with pytest.raises(p.ProtocolError, match="grace_s"):
        p.encode(p.message(p.PreemptNotice(job_id="1", grace_s=-1.0, reason="r")))


def test_preempt_notice_avoid_gpus_is_optional_and_bounded():
    env = _wire(p.PreemptNotice(job_id="1", grace_s=1, reason="r"))
    env["body"].pop("avoid_gpus", None)  # what a coordinator from before placement memory sends
    assert _decode(env, p.COORDINATOR_TO_SIDECAR).body.avoid_gpus is None
    for bad in ([1024], [-1], ["0"]):
        with pytest.raises(p.ProtocolError, match="avoid_gpus"):
            p.encode(p.message(p.PreemptNotice(job_id="1", grace_s=1, reason="r", avoid_gpus=bad)))
