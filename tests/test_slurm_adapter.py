"""The CLI Slurm backend against a real local Slurm 22.05 cluster (plain Slurm, fake GPUs)."""

from __future__ import annotations

import time

import pytest

from slurm_antman.slurm import (CliBackend, CommandFailed, JobEnded, JobNotFound, SlurmUnavailable,
                                SubmissionRejected, WaitTimeout)


pytestmark = pytest.mark.cluster


def test_submit_gpu_job_and_read_it_back(backend):
    jid = backend.submit(wrap="sleep 30", options=["--gres=gpu:2", "-J", "two gpus", "--comment=a Partition=x b"])
    job = backend.wait_for(jid, ["RUNNING"], timeout=30)
    assert (job.job_id, job.name, job.partition, job.comment) == (jid, "two gpus", "gpu", "a Partition=x b")
    assert job.antman_class == "none" and job.user == "root"
    assert len(job.nodes) == 1 and len(job.gpus) == 2 and set(job.gpus) <= {0, 1, 2, 3}
    listed = {j.job_id: j for j in backend.jobs()}
    assert listed[jid].gpus_by_node == job.gpus_by_node  # squeue --json and scontrol agree
    assert [j.job_id for j in backend.jobs(states=["RUNNING"]) if j.job_id == jid] == [jid]
    assert all(j.job_id != jid for j in backend.jobs(states=["PENDING"]))


def test_multi_node_gpus(backend):
    jid = backend.submit(wrap="sleep 30", options={"nodes": 2, "gres": "gpu:1"})
    job = backend.wait_for(jid, ["RUNNING"], timeout=30)
    assert sorted(job.gpus_by_node) == ["node1", "node2"]
    assert all(len(idx) == 1 for idx in job.gpus_by_node.values())


def test_hold_release_update_requeue_cancel(backend):
    jid = backend.submit(wrap="sleep 30", options={"hold": True, "job_name": "steer"})
    job = backend.job(jid)
    assert (job.state, job.reason) == ("PENDING", "JobHeldUser")
    backend.update(jid, admin_comment="antman:class=opportunistic;gpus=node2:3", TimeLimit=5)
    job = backend.job(jid)
    # raw is what the backend read: scontrol's text (TimeLimit=00:05:00) or, from 25.11, its JSON (minutes)
    limit = job.raw.get("TimeLimit", job.raw.get("time_limit"))
    assert job.antman_class == "opportunistic" and limit in ("00:05:00", {"set": True, "infinite": False, "number": 5})
    backend.release(jid)
    job = backend.wait_for(jid, ["RUNNING"], timeout=30)
    assert job.gpus_by_node == {"node2": [3]}  # an opportunistic job's GPUs come from its tag
    backend.requeue(jid, hold=True)
    job = backend.wait_for(jid, ["PENDING"], timeout=30)
    assert job.restarts == 1
    backend.hold(jid)
    backend.cancel(jid)
    assert backend.wait_for(jid, ["CANCELLED"], timeout=30).finished


def test_signal_reaches_the_batch_script(backend, plain_cluster, tmp_path):
    out, ready = tmp_path / "sig.out", tmp_path / "trap-set"
    script = (f"#!/bin/bash\ntrap 'echo got-usr1 > {out}; exit 0' USR1\ntouch {ready}\n"
              "while true; do sleep 1; done\n")
    jid = backend.submit(script_text=script, options=[f"--output={tmp_path}/job.out"])
    backend.wait_for(jid, ["RUNNING"], timeout=30)
    # RUNNING is Slurm's word; the script may not have set its trap yet (USR1 would then kill it).
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    backend.cancel(jid, signal="USR1")
    backend.wait_for(jid, ["COMPLETED"], timeout=30)
    assert out.read_text().strip() == "got-usr1"


def test_unknown_job_gives_job_not_found_with_slurms_message(backend):
    for call in (lambda: backend.job(999999), lambda: backend.hold(999999), lambda: backend.cancel(999999),
                 lambda: backend.requeue(999999), lambda: backend.update(999999, Comment="x")):
        with pytest.raises(JobNotFound, match="Invalid job id specified") as e:
            call()
        assert e.value.job_id == 999999 and e.value.command


def test_rejected_submission_carries_sbatch_message(backend):
    with pytest.raises(SubmissionRejected, match="Invalid partition name specified") as e:
        backend.submit(wrap="true", options=["-p", "nosuchpartition"])
    assert e.value.command[:2] == ["sbatch", "--parsable"] and "nosuchpartition" in str(e.value)


def test_bad_update_field_is_command_failed(backend):
    jid = backend.submit(wrap="sleep 30", options={"hold": True})
    with pytest.raises(CommandFailed, match="not supported: Foo=bar"):
        backend.update(jid, Foo="bar")


def test_wait_for_timeout_and_ended(backend):
    jid = backend.submit(wrap="sleep 30", options={"hold": True})
    with pytest.raises(WaitTimeout, match=f"job {jid} still PENDING"):
        backend.wait_for(jid, ["RUNNING"], timeout=1)
    # Waiting for COMPLETED, not RUNNING: a poll may catch the short job RUNNING before it fails.
    quick = backend.submit(wrap="exit 3")
    with pytest.raises(JobEnded, match="FAILED"):
        backend.wait_for(quick, ["COMPLETED"], timeout=30)


def test_nodes(backend):
    nodes = {n.name: n for n in backend.nodes()}
    assert sorted(nodes) == ["node1", "node2"]
    assert nodes["node1"].gres["gpu"] == 4 and nodes["node1"].state in ("IDLE", "MIXED", "ALLOCATED")


def test_bad_arguments_are_specific(backend):
    with pytest.raises(ValueError, match="exactly one of"):
        backend.submit(wrap="true", script_text="#!/bin/sh\n")
    with pytest.raises(ValueError, match="positive integer"):
        backend.job(-1)
    with pytest.raises(ValueError, match="not a signal"):
        backend.cancel(1, signal="KILL; rm")
    with pytest.raises(ValueError, match="one line"):
        backend.update(1, Comment="a\nb")


def test_controller_down_is_slurm_unavailable(plain_cluster, tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text(plain_cluster.slurm_conf.read_text().replace(
        f"SlurmctldPort={plain_cluster.port_base}", f"SlurmctldPort={plain_cluster.port_base + 90}"))
    env = dict(plain_cluster.env, SLURM_CONF=str(conf))
    b = CliBackend(env=env, timeout=3)
    with pytest.raises(SlurmUnavailable) as e:
        b.jobs()
    assert e.value.command[0] in ("squeue", "scontrol")
    with pytest.raises(SlurmUnavailable):
        b.job(1)
    missing = CliBackend(env=dict(env, PATH="/nonexistent"))
    with pytest.raises(SlurmUnavailable, match="not found on PATH"):
        missing.nodes()
