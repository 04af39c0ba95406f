"""Tasks of one elastic array across nodes never share a GPU, through a real sidecar (served in a thread
over its IPC control socket): the Prolog sends the array's job id as ``job_register.elastic_group``, the
sidecar refuses a task a GPU its siblings hold (placement ``wait``: the Prolog requeues it), and a
restarted sidecar still knows which jobs are whose tasks (docs/elastic.md, "Tasks never share a GPU")."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from slurm_antman import config as cfgmod
from slurm_antman import envfile, prolog_epilog
from slurm_antman import protocol as p
from slurm_antman.clients import sidecar_control as client

from test_prolog_elastic import FakeJob, FakeSlurm
from test_sidecar_daemon import Running, make_config, sockdir  # noqa: F401 - a fixture

ACROSS = "antman:class=opportunistic;elastic=1:3"  # a one-GPU task of a three-task array


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Node n1 of 2 idle GPUs, two opportunistic slots each, no_room: wait (the default)."""
    sockets = tempfile.mkdtemp(prefix="am-", dir="/tmp")
    dev = tmp_path / "dev"
    dev.mkdir()
    for i in range(2):
        os.mknod(dev / f"nvidia{i}", 0o600 | 0o020000, os.makedev(1, 3))
    cfg = cfgmod.parse({
        "state_dir": str(tmp_path / "state"),
        "nodes": [{"name": "n1", "gpus": 2, "gpu_memory_mb": 16384, "gpu_files": f"{dev}/nvidia[0-1]"}],
        "sidecar": {"heartbeat_s": 0.2, "telemetry": "emulated", "socket_dir": sockets},
    })
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))  # no cgroup.conf beside it
    sidecar = Running(cfg.node_socket_dir("n1"), cfg)
    try:
        yield cfg, sidecar
    finally:
        sidecar.stop()
        shutil.rmtree(sockets, ignore_errors=True)


def run_prolog(cfg, monkeypatch, job_id: str, comment: str, tres: str = "gres:antman_opp:1",
               array: int | None = None, task: str | None = "0",
               env_extra: dict[str, str] | None = None) -> tuple[int, FakeSlurm, dict[str, str]]:
    """The Prolog as slurmd runs it; the array comes from slurmctld's record (``array``, ``task``): slurmd
    22.05 puts no SLURM_ARRAY_JOB_ID into a Prolog's environment."""
    slurm = FakeSlurm(FakeJob(job_id, comment, tres, "n1", array, task if array is not None else None))
    monkeypatch.setattr(prolog_epilog, "_slurm", lambda *a, **k: slurm)
    env = {"SLURM_JOB_ID": job_id, "SLURMD_NODENAME": "n1", "SLURM_JOB_UID": "0", "SLURM_JOB_USER": "root",
           p.ENV_SPANK_CLASS: "opportunistic", "SLURM_JOB_PARTITION": "opportunistic", **(env_extra or {})}
    rc = prolog_epilog.prolog(cfg, env)
    values = envfile.parse_env(envfile.path(cfg.state_dir, "n1", job_id).read_bytes())
    return rc, slurm, values


def test_the_third_task_of_an_array_on_a_node_of_two_gpus_is_refused_and_requeued(node, monkeypatch):
    cfg, sidecar = node
    placed = []
    for job_id, task in (("901", "0"), ("902", "1")):
        rc, slurm, values = run_prolog(cfg, monkeypatch, job_id, ACROSS, array=900, task=task)
        assert rc == 0 and not slurm.requeued and p.ENV_REFUSED not in values
        assert sidecar.sidecar.jobs[job_id].elastic_group == "900"
        placed.append(values[p.ENV_GPUS])
    assert sorted(placed) == ["0", "1"]  # one GPU each, though each GPU has two slots
    rc, slurm, values = run_prolog(cfg, monkeypatch, "903", ACROSS, array=900, task="2")
    assert rc == 0 and slurm.requeued == ["903"]  # the fake's slurm_id: the Prolog requeues the task alone
    assert "903" not in sidecar.sidecar.jobs and values[p.ENV_GPUS] == ""
    assert "another task of the job's elastic array runs there" in values[p.ENV_REFUSED]
    # Another array's task, and a plain job, still find the GPUs' free slots.
    rc, slurm, values = run_prolog(cfg, monkeypatch, "911", ACROSS, array=910)
    assert rc == 0 and not slurm.requeued and sidecar.sidecar.jobs["911"].elastic_group == "910"
    rc, slurm, values = run_prolog(cfg, monkeypatch, "920", "antman:class=opportunistic")
    assert rc == 0 and not slurm.requeued and sidecar.sidecar.jobs["920"].elastic_group is None


def test_only_a_task_of_an_array_across_nodes_registers_its_group(node, monkeypatch):
    """A sweep's task (MAX the task's own GPUs: an elastic job of its own) changes width on its node and
    shares nothing with the sweep's other tasks: no group, so two of them may share a GPU's slots."""
    cfg, sidecar = node
    rc, _, values = run_prolog(cfg, monkeypatch, "931", "antman:class=opportunistic;elastic=1:2",
                               tres="gres:antman_opp:2", array=930)
    assert rc == 0 and values[p.ENV_ELASTIC] == "1:2"
    job = sidecar.sidecar.jobs["931"]
    assert (job.elastic_min, job.elastic_group) == (1, None)
    rc, slurm, values = run_prolog(cfg, monkeypatch, "932", "antman:class=opportunistic;elastic=1:2",
                                   tres="gres:antman_opp:2", array=930, task="1")
    assert rc == 0 and not slurm.requeued and sorted(sidecar.sidecar.jobs["932"].gpus) == [0, 1]


@pytest.mark.parametrize("array, task", [(None, None), (12345678901, "0"), (960, None)])
def test_only_slurmctlds_record_names_the_array(node, monkeypatch, caplog, array, task):
    """Not an array task in slurmctld's record (an admin's tag), an id over 10 digits, or a record without
    a task index: registered without a group, and run, whatever the environment says."""
    cfg, sidecar = node
    with caplog.at_level(logging.WARNING, logger="antman.node"):
        rc, slurm, values = run_prolog(cfg, monkeypatch, "951", ACROSS, array=array, task=task,
                                       env_extra={"SLURM_ARRAY_JOB_ID": "900", "SLURM_ARRAY_TASK_ID": "1"})
    assert rc == 0 and not slurm.requeued and p.ENV_REFUSED not in values
    assert sidecar.sidecar.jobs["951"].elastic_group is None
    assert "job 951 on n1: a task of an elastic array across nodes whose record names no array" in caplog.text


def _task(sockdir: str, job_id: str, group: str | None = "900", job_class: str = "opportunistic", **kw):
    return client.register_job(sockdir, job_id, uid=0, user="r", job_class=job_class, gpus=kw.pop("gpus", 1),
                               may_wait=True, elastic_group=group, **kw)


def test_a_restarted_sidecar_keeps_the_group_and_still_keeps_the_tasks_apart(sockdir):  # noqa: F811
    r = Running(sockdir, make_config(gpus=2))
    try:
        assert _task(sockdir, "301").placement == "fit" and _task(sockdir, "302").placement == "fit"
    finally:
        r.stop()
    r = Running(sockdir, make_config(gpus=2))
    try:
        assert {j: r.sidecar.jobs[j].elastic_group for j in ("301", "302")} == {"301": "900", "302": "900"}
        reply = _task(sockdir, "303")
        assert (reply.placement, reply.gpus) == ("wait", []) and "elastic array" in reply.note
        assert _task(sockdir, "304", group=None).placement == "fit"
    finally:
        r.stop()


def test_a_record_with_a_malformed_group_is_not_restored(sockdir, caplog):  # noqa: F811
    r = Running(sockdir, make_config(gpus=2))
    try:
        _task(sockdir, "311")
        state = Path(r.sidecar.dir.state_dir) / "311.json"
    finally:
        r.stop()
    rec = json.loads(state.read_text())
    assert rec["elastic_group"] == "900"
    state.write_text(json.dumps({**rec, "elastic_group": "9/../0"}))
    with caplog.at_level(logging.WARNING, logger="antman.sidecar"):
        r = Running(sockdir, make_config(gpus=2))
    try:
        assert "311" not in r.sidecar.jobs
        assert "could not restore saved job '311': bad elastic group '9/../0'" in caplog.text
    finally:
        r.stop()


def test_a_guaranteed_job_with_a_group_is_refused_by_name(sockdir):  # noqa: F811
    r = Running(sockdir, make_config(gpus=2))
    try:
        with pytest.raises(client.SidecarError, match="elastic_group must be null for guaranteed"):
            _task(sockdir, "321", job_class="guaranteed", physical_gpus=[0])
        assert client.node_state(sockdir).jobs == []
    finally:
        r.stop()
