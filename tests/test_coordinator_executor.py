"""The coordinator's executor against the real devcluster: decisions Slurm 22.05 cannot carry out
consistently are refused, never half done."""

from __future__ import annotations

import time

import pytest

from slurm_antman import config
from slurm_antman.coordinator.executor import Executor
from slurm_antman.jobtag import parse_tag
from slurm_antman.policy.cluster.decisions import KeepOff, MakeEligible, SetClass
from slurm_antman.slurm import CliBackend

pytestmark = pytest.mark.cluster


def test_pending_gpu_job_keeps_its_class(clean_cluster):
    c = clean_cluster
    cfg = config.load(c.c.config_path)
    ex = Executor(CliBackend(env=c.env), cfg)
    jid = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "--hold", wrap="sleep 30")
    before = c.show(jid)
    out = ex.execute(SetClass(str(jid), "guaranteed", reason="test"))
    after = c.show(jid)
    # A guaranteed tag on a job Slurm still schedules by the opportunistic GRES would start a
    # "guaranteed" job without a physical GPU: the executor leaves the job as it was.
    assert out.outcome == "skipped" and "cannot move" in out.detail, out
    assert parse_tag(after["AdminComment"]).job_class == "opportunistic"
    assert (after["Partition"], after["TresPerNode"]) == (before["Partition"], before["TresPerNode"])


def test_keep_off_sets_and_clears_a_pending_jobs_exclusions_and_it_waits_meanwhile(clean_cluster):
    """Slurm 22.05 takes ExcNodeList on a pending job; excluded from every node the job stays pending
    (not rejected), and starts once a node is let back; a running job is left alone."""
    c = clean_cluster
    cfg = config.load(c.c.config_path)
    ex = Executor(CliBackend(env=c.env), cfg)
    jid = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "--hold", wrap="sleep 30")
    out = ex.execute(KeepOff(str(jid), ("node1", "node2"), reason="test"))
    assert out.outcome == "ok", out
    info = c.show(jid)
    assert info["ExcNodeList"] == "node[1-2]" or info["ExcNodeList"] == "node1,node2", info
    assert CliBackend(env=c.env).job(jid).excluded_nodes == ["node1", "node2"]
    c.run(["scontrol", "release", str(jid)])
    time.sleep(3)
    info = c.show(jid)
    assert info["JobState"] == "PENDING", info
    assert ex.execute(KeepOff(str(jid), ("node1",))).outcome == "ok"
    info = c.wait_state(jid, {"RUNNING"}, timeout=30)
    assert info["NodeList"] == "node2"
    out = ex.execute(KeepOff(str(jid), ()))
    # Retried: a job seen pending and started in the same second may be a Prolog's refusal away from
    # pending again (the core decides no KeepOff for a job it sees running).
    assert out.outcome == "skipped" and "RUNNING" in out.detail and out.retry, out


def test_make_eligible_and_keep_off_on_a_job_not_pending_yet_are_retried_never_on_a_running_one(clean_cluster):
    """The policy emits MakeEligible from a snapshot that showed the requeued job PENDING; if scontrol does
    not show it PENDING yet, the outcome asks for a retry (else the job sat out Slurm's ~121 s BeginTime
    wait). A suspended job stands in for a requeue still in flight: neither pending nor running."""
    c = clean_cluster
    cfg = config.load(c.c.config_path)
    ex = Executor(CliBackend(env=c.env), cfg)
    jid = c.sbatch("--antman=opportunistic", "--gres=gpu:1", wrap="sleep 60")
    c.wait_state(jid, {"RUNNING"}, timeout=30)
    running = ex.execute(MakeEligible(str(jid), reason="test"))
    assert running.outcome == "skipped" and not running.retry, running
    c.run(["scontrol", "suspend", str(jid)], check=True)
    c.wait_state(jid, {"SUSPENDED"}, timeout=15)
    suspended = ex.execute(MakeEligible(str(jid), reason="test"))
    assert suspended.outcome == "skipped" and suspended.retry and "SUSPENDED" in suspended.detail, suspended
    # keep_off likewise (seen under 24.11: the Prolog's requeue left the job COMPLETING at the decision,
    # and without a retry it started on the node with no room once more).
    kept = ex.execute(KeepOff(str(jid), ("node1",), reason="test"))
    assert kept.outcome == "skipped" and kept.retry and "SUSPENDED" in kept.detail, kept
    c.run(["scontrol", "resume", str(jid)], check=True)
