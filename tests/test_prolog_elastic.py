"""The Prolog and an elastic job (docs/elastic.md): ``antman node prolog`` against a
real sidecar (served in a thread over its IPC control socket), with Slurm stood in for by a small fake
that holds the job's record. An opportunistic job tagged ``elastic=MIN:MAX`` is registered with
``elastic_min=MIN`` and its env file says ``ANTMAN_ELASTIC=MIN:MAX``; a task of an elastic job array across
nodes gets the same env but registers without ``elastic_min``; any other job registers as before."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from slurm_antman import config as cfgmod
from slurm_antman import envfile, prolog_epilog
from slurm_antman import protocol as p
from slurm_antman.jobtag import parse_tag

from test_sidecar_daemon import Running


class FakeJob:
    def __init__(self, job_id: str, admin_comment: str, tres_per_node: str, node: str,
                 array_job_id: int | None = None, array_task: str | None = None) -> None:
        self.job_id, self.slurm_id = int(job_id), job_id
        self.admin_comment, self.tres_per_node, self.nodelist = admin_comment, tres_per_node, node
        self.array_job_id, self.array_task = array_job_id, array_task

    def checked_tag(self):
        return parse_tag(self.admin_comment)


class FakeSlurm:
    """What the Prolog asks of Slurm: the job's record, AdminComment updates, a requeue."""

    def __init__(self, job: FakeJob) -> None:
        self.record, self.requeued = job, []

    def job(self, job_id: Any) -> FakeJob:
        assert str(job_id) == self.record.slurm_id
        return self.record

    def update(self, ref: str, **fields: str) -> None:
        self.record.admin_comment = fields.get("AdminComment", self.record.admin_comment)

    def requeue(self, ref: str) -> None:
        self.requeued.append(ref)


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A node n1 of 2 GPUs (character devices of its own) with its sidecar running; yields the config."""
    sockets = tempfile.mkdtemp(prefix="am-", dir="/tmp")  # Unix socket paths are short
    dev = tmp_path / "dev"
    dev.mkdir()
    for i in range(2):
        os.mknod(dev / f"nvidia{i}", 0o600 | 0o020000, os.makedev(1, 3))
    cfg = cfgmod.parse({
        "state_dir": str(tmp_path / "state"),
        "nodes": [{"name": "n1", "gpus": 2, "gpu_memory_mb": 16384, "gpu_files": f"{dev}/nvidia[0-1]"}],
        "sidecar": {"heartbeat_s": 0.2, "telemetry": "emulated", "socket_dir": sockets},
        "opportunistic": {"no_room": "fallback"},
    })
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))  # no cgroup.conf beside it
    sidecar = Running(cfg.node_socket_dir("n1"), cfg)
    try:
        yield cfg, sidecar
    finally:
        sidecar.stop()
        shutil.rmtree(sockets, ignore_errors=True)


def run_prolog(cfg, monkeypatch, job_id: str, comment: str, tres: str, job_class: str = "opportunistic",
               slurm_gpus: str = "") -> tuple[int, FakeSlurm, dict[str, str]]:
    slurm = FakeSlurm(FakeJob(job_id, comment, tres, "n1"))
    monkeypatch.setattr(prolog_epilog, "_slurm", lambda *a, **k: slurm)
    env = {"SLURM_JOB_ID": job_id, "SLURMD_NODENAME": "n1", "SLURM_JOB_UID": "0", "SLURM_JOB_USER": "root",
           p.ENV_SPANK_CLASS: job_class, "SLURM_JOB_PARTITION": "opportunistic" if job_class == "opportunistic" else "gpu",
           "SLURM_JOB_GPUS": slurm_gpus}
    rc = prolog_epilog.prolog(cfg, env)
    values = envfile.parse_env(envfile.path(cfg.state_dir, "n1", job_id).read_bytes())
    return rc, slurm, values


def test_an_elastic_job_registers_its_narrowest_width(node, monkeypatch) -> None:
    cfg, sidecar = node
    rc, slurm, values = run_prolog(cfg, monkeypatch, "501", "antman:class=opportunistic;elastic=1:2",
                                   "gres:antman_opp:2")
    assert rc == 0 and not slurm.requeued
    job = sidecar.sidecar.jobs["501"]
    assert job.elastic_min == 1 and sorted(job.gpus) == [0, 1]
    assert values[p.ENV_ELASTIC] == "1:2"
    assert sorted(values[p.ENV_GPUS].split(",")) == ["0", "1"] and p.ENV_REFUSED not in values
    # the tag keeps its range next to the GPUs the Prolog recorded
    assert slurm.record.admin_comment == "antman:class=opportunistic;elastic=1:2;gpus=n1:0+1"


def test_a_job_that_is_not_elastic_registers_without_it(node, monkeypatch) -> None:
    cfg, sidecar = node
    rc, _, values = run_prolog(cfg, monkeypatch, "502", "antman:class=opportunistic", "gres/antman_opp:2")
    assert rc == 0
    assert sidecar.sidecar.jobs["502"].elastic_min is None
    assert p.ENV_ELASTIC not in values


def test_a_range_whose_max_is_not_the_slots_held_is_ignored(node, monkeypatch, caplog) -> None:
    cfg, sidecar = node
    with caplog.at_level(logging.WARNING, logger="antman.node"):
        rc, slurm, values = run_prolog(cfg, monkeypatch, "503", "antman:class=opportunistic;elastic=1:4",
                                       "gres:antman_opp:2")
    assert rc == 0 and not slurm.requeued  # runs at its full width, not refused
    assert sidecar.sidecar.jobs["503"].elastic_min is None
    assert p.ENV_ELASTIC not in values and sorted(values[p.ENV_GPUS].split(",")) == ["0", "1"]
    assert "job 503 on n1: its tag says elastic=1:4 but it holds 2 GPU slot(s) here; not elastic" in caplog.text


def test_a_guaranteed_job_with_a_range_in_its_tag_is_not_elastic(node, monkeypatch) -> None:
    """An opportunistic elastic job the coordinator upgraded keeps the range in its tag; a requeued run
    starts guaranteed, on the GPUs Slurm bound (the sidecar refuses elastic_min for a guaranteed job)."""
    cfg, sidecar = node
    rc, _, values = run_prolog(cfg, monkeypatch, "504", "antman:class=guaranteed;req=opportunistic;elastic=1:2",
                               "gres:gpu:2", job_class="opportunistic", slurm_gpus="0,1")
    assert rc == 0
    job = sidecar.sidecar.jobs["504"]
    assert job.job_class == "guaranteed" and job.elastic_min is None
    assert p.ENV_ELASTIC not in values and values[p.ENV_CLASS] == "guaranteed"


def test_a_task_of_an_array_across_nodes_gets_the_range_but_registers_without_it(node, monkeypatch, caplog) -> None:
    """--array=0-3 --gres=gpu:2 --antman-elastic=4:8: each task holds 2 slots here and is one node's share
    of one job. The launcher needs the whole range; the node never changes the task's width GPU by GPU
    (its shed is the requeue of the task), so the sidecar gets no elastic_min."""
    cfg, sidecar = node
    with caplog.at_level(logging.INFO, logger="antman.node"):
        rc, slurm, values = run_prolog(cfg, monkeypatch, "506", "antman:class=opportunistic;elastic=4:8",
                                       "gres:antman_opp:2")
    assert rc == 0 and not slurm.requeued
    job = sidecar.sidecar.jobs["506"]
    assert job.elastic_min is None and sorted(job.gpus) == [0, 1]
    assert values[p.ENV_ELASTIC] == "4:8" and p.ENV_REFUSED not in values
    assert sorted(values[p.ENV_GPUS].split(",")) == ["0", "1"]
    assert slurm.record.admin_comment == "antman:class=opportunistic;elastic=4:8;gpus=n1:0+1"
    assert "elastic 4:8 across nodes" in caplog.text and "not elastic" not in caplog.text


def test_a_one_gpu_task_of_an_array_across_nodes(node, monkeypatch) -> None:
    cfg, sidecar = node
    rc, _, values = run_prolog(cfg, monkeypatch, "507", "antman:class=opportunistic;elastic=1:3", "gres:antman_opp:1")
    assert rc == 0
    assert sidecar.sidecar.jobs["507"].elastic_min is None and values[p.ENV_ELASTIC] == "1:3"


def test_an_array_range_whose_min_is_not_whole_nodes_is_ignored(node, monkeypatch, caplog) -> None:
    """elastic=3:8 on a task of 2 slots fits neither kind (job_submit.lua refuses it): not elastic."""
    cfg, sidecar = node
    with caplog.at_level(logging.WARNING, logger="antman.node"):
        rc, slurm, values = run_prolog(cfg, monkeypatch, "508", "antman:class=opportunistic;elastic=3:8",
                                       "gres:antman_opp:2")
    assert rc == 0 and not slurm.requeued
    assert sidecar.sidecar.jobs["508"].elastic_min is None and p.ENV_ELASTIC not in values
    assert "job 508 on n1: its tag says elastic=3:8 but it holds 2 GPU slot(s) here; not elastic" in caplog.text
