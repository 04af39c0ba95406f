"""The coordinator writes each pause in place and each resume its sidecars report into the audit log, for
`antman explain`, even when several reports arrive between two cycles (found by `make demo`: a
resume half a second before the next pause was lost, so explain told of one long pause)."""

from __future__ import annotations

import json

from slurm_antman import config as cfgmod
from slurm_antman import protocol as p
from slurm_antman.coordinator.daemon import Coordinator
from slurm_antman.coordinator.explain import explain
from slurm_antman.coordinator.hub import HeardReport
from slurm_antman.slurm import CliBackend


def _report(node: str, paused_jobs: dict[str, bool], at: float) -> HeardReport:
    jobs = [p.ReportJob(job_id=j, job_class="opportunistic", gpus=[0], mem_limit_bytes=None, mem_used_bytes=None,
                        compute_share=0.5, iteration_ms=None, last_checkpoint_unix=None, paused=paused,
                        pause_reason="GPU 0: guaranteed demand leaves too little" if paused else "")
            for j, paused in paused_jobs.items()]
    body = p.NodeReport(node=node, telemetry="emulated", gpus=[], jobs=jobs, preempt_requests=[])
    # Encoded and decoded as the uplink does, so the optional fields are the ones that travel.
    return HeardReport(node, at, p.decode(p.encode(p.message(body))).body)


def _coordinator(tmp_path) -> Coordinator:
    cfg = cfgmod.parse({"nodes": [{"name": "n1", "gpus": 1}, {"name": "n2", "gpus": 1}],
                        "coordinator": {"audit_log": str(tmp_path / "audit.jsonl")}})
    # No Slurm commands on this PATH: these tests never reach a cycle.
    return Coordinator(cfg, backend=CliBackend(env={"PATH": str(tmp_path)}, timeout=5))


def _kinds(tmp_path, job: str) -> list[str]:
    return [r["kind"] for r in map(json.loads, (tmp_path / "audit.jsonl").read_text().splitlines())
            if r.get("job_id") == job]


def test_a_resume_and_the_next_pause_between_two_cycles_are_both_recorded(tmp_path):
    coord = _coordinator(tmp_path)
    coord._take([_report("n1", {"7": True}, 1.0)])
    coord._take([_report("n1", {"7": True}, 2.0),  # still paused: nothing new
                 _report("n1", {"7": False}, 2.4), _report("n1", {"7": True}, 2.9)])
    coord._take([_report("n1", {"7": False}, 4.0)])
    coord.audit.close()
    assert _kinds(tmp_path, "7") == ["paused", "resumed", "paused", "resumed"]
    text, rc = explain("7", str(tmp_path / "audit.jsonl"))
    assert rc == 0 and text.count("paused in place on n1") == 2 and text.count("resumed on n1") == 2, text


def test_another_nodes_report_does_not_end_a_pause_and_a_job_that_ends_paused_is_forgotten(tmp_path):
    coord = _coordinator(tmp_path)
    coord._take([_report("n1", {"7": True}, 1.0), _report("n2", {"8": False}, 1.1)])
    coord._take([_report("n2", {}, 2.0)])  # n2 says nothing of job 7: its pause goes on
    coord._take([_report("n1", {}, 3.0)])  # job 7 ended (or was requeued) while paused: no resume
    coord._take([_report("n1", {"7": True}, 4.0)])  # the requeued job 7 pauses again: a new pause
    coord.audit.close()
    assert _kinds(tmp_path, "7") == ["paused", "paused"]
    assert _kinds(tmp_path, "8") == []
