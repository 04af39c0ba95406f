"""Node hooks and the AdminComment tag, without a cluster (the cluster tests cover them end to end)."""

from __future__ import annotations

import stat

import pytest

from slurm_antman import config
from slurm_antman.jobtag import JobTag, TagError, parse_tag
from slurm_antman import envfile
from slurm_antman.prolog_epilog import JobContext


def test_tag_round_trip_and_merge():
    tag = parse_tag("antman:class=opportunistic")
    assert tag == JobTag("opportunistic")
    merged = tag.with_gpus("node2", [3]).with_gpus("node1", [2, 0])
    text = merged.render()
    assert text == "antman:class=opportunistic;gpus=node1:0+2,node2:3"
    assert parse_tag(text) == merged
    assert merged.all_gpus == [0, 2, 3]


@pytest.mark.parametrize("text", [None, "", "(null)", "user words", "antmanx"])
def test_untagged_is_class_none(text):
    assert parse_tag(text) is None


@pytest.mark.parametrize("text", ["antman:class=best", "antman:class", "antman:class=guaranteed;gpus=n1:x",
                                  "antman:class=guaranteed;gpus=n1"])
def test_damaged_tag_raises(text):
    with pytest.raises(TagError):
        parse_tag(text)


def test_env_file_atomic_and_root_only_writable(tmp_path):
    cfg = config.parse({"state_dir": str(tmp_path), "nodes": [{"name": "n1", "gpus": 4}]})
    f = envfile.path(cfg.state_dir, "n1", "42")
    assert f == tmp_path / "n1" / "jobs" / "42.env"
    envfile.write(f, {"ANTMAN_CLASS": "opportunistic", "ANTMAN_GPUS": "2", "CUDA_VISIBLE_DEVICES": "2"})
    lines = [l for l in f.read_text().splitlines() if not l.startswith("#")]
    assert lines == ["ANTMAN_CLASS=opportunistic", "ANTMAN_GPUS=2", "CUDA_VISIBLE_DEVICES=2"]
    mode = stat.S_IMODE(f.stat().st_mode)
    assert mode & (stat.S_IWGRP | stat.S_IWOTH) == 0  # the SPANK plugin refuses group/world-writable files
    assert not list(f.parent.glob("*.tmp"))
    with pytest.raises(ValueError):
        envfile.write(f, {"X": "a\nEVIL=1"})


def test_job_context_from_prolog_env():
    ctx = JobContext.from_env({"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "node2", "SLURM_JOB_UID": "1000",
                               "SLURM_JOB_USER": "ada", "SPANK_ANTMAN_CLASS": "auto",
                               "SLURM_JOB_PARTITION": "gpu", "SLURM_JOB_GPUS": "1,3",
                               "SLURM_JOB_ACCOUNT": "vision"})
    assert (ctx.job_id, ctx.node, ctx.uid, ctx.user, ctx.spank_class) == ("7", "node2", 1000, "ada", "auto")
    assert ctx.account == "vision"
    assert ctx.slurm_gpus == [1, 3]
    assert JobContext.from_env({"SLURM_JOB_ID": "8"}).slurm_gpus == []


def test_node_without_slurmd_nodename_and_no_controller_is_the_hostname(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-such-slurm.conf"))
    ctx = JobContext.from_env({"SLURM_JOB_ID": "7", "ANTMAN_PROLOG_FROM_SPANK": "1"})
    assert ctx.node == os.uname().nodename.split(".")[0]


@pytest.mark.cluster
def test_node_without_slurmd_nodename_comes_from_the_job(clean_cluster, monkeypatch):
    """What the SPANK plugin's Prolog run gets: no SLURMD_NODENAME, so the one node of the job."""
    c = clean_cluster
    monkeypatch.setenv("SLURM_CONF", c.env["SLURM_CONF"])
    jid = c.sbatch("-w", "node2", wrap="sleep 30")
    c.wait_state(jid, {"RUNNING"})
    assert JobContext.from_env({"SLURM_JOB_ID": str(jid)}).node == "node2"
    # slurmd's own value still wins, without asking the controller.
    assert JobContext.from_env({"SLURM_JOB_ID": str(jid), "SLURMD_NODENAME": "node1"}).node == "node1"
    two = c.sbatch("-N", "2", wrap="sleep 30")
    c.wait_state(two, {"RUNNING"})
    import os

    assert JobContext.from_env({"SLURM_JOB_ID": str(two)}).node == os.uname().nodename.split(".")[0]


@pytest.mark.parametrize("tres, count", [
    ("gres:antman_opp:2", 2), ("gres/antman_opp:3", 3), ("gres:antman_opp:h100:2", 2),
    ("gres/nic:1,gres/antman_opp:a100:4", 4), ("gres:gpu:h100:1", None),
])
def test_the_prolog_reads_an_opportunistic_jobs_slots_typed_or_not(tres, count):
    """job_submit.lua keeps a GPU type on the slots (antman_opp:h100:N): the Prolog's count must read both."""
    import re

    from slurm_antman import prolog_epilog

    m = re.search(prolog_epilog._TRES_OPP.format(name="antman_opp"), tres)
    assert (int(m.group(1)) if m else None) == count


def test_env_file_round_trips_what_the_plugin_reads():
    values = {"ANTMAN_CLASS": "opportunistic", "ANTMAN_REFUSED": "no GPU = free; see  log\r", "_X1": ""}
    assert envfile.parse_env(envfile.format_env(values)) == values
    # What envfile.c skips: comments, blanks, bad keys, NUL lines; a later duplicate wins (setenv overwrites).
    assert envfile.parse_env(b"# c\n \t\nlower=1\n=2\nA\0=3\nNOEQ\nA=1\nA=2") == {"A": "2"}
    for bad in ({"lower": "1"}, {"A": "x\0y"}, {"A": "x" * envfile.MAX_BYTES}):
        with pytest.raises(envfile.EnvFileError):
            envfile.format_env(bad)
    with pytest.raises(envfile.EnvFileError):
        envfile.parse_env(b"A=1\n" * (envfile.MAX_BYTES // 4 + 1))
    assert len(envfile.parse_env(b"".join(b"K%d=1\n" % i for i in range(300)))) == envfile.MAX_ENTRIES
