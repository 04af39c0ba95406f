"""--antman-elastic=MIN:MAX on the session's real Slurm cluster (docs/elastic.md),
submitted by the unprivileged submitter: the plugin refuses a bad value at sbatch, job_submit.lua
refuses a range that does not fit the job, and an accepted job carries the range in its tag and its
environment."""

from __future__ import annotations

import time

import pytest

from slurm_antman.jobtag import ACROSS_NODES, elastic_kind, parse_tag
from slurm_antman.lab.devcluster.jobs import wait_for
from slurm_antman.slurm.parsing import parse_scontrol_line

pytestmark = pytest.mark.cluster

SCRIPT = """#!/bin/bash
echo "ELASTIC=${ANTMAN_ELASTIC:-} SPANK=${SLURM_SPANK_ANTMAN_ELASTIC:-} GPUS=${ANTMAN_GPUS:-}"
sleep 30
"""


def _refused(c, *args: str) -> str:
    """sbatch's stderr for a submission that must fail and leave no job (named uniquely, so that jobs
    of other tests, ending meanwhile, do not count)."""
    name = f"elastic-refused-{time.monotonic_ns()}"
    r = c.sbatch(f"--job-name={name}", *args, wrap="true", expect_ok=False)
    assert r.returncode != 0, r.stdout
    assert c.run(["squeue", "-h", "-n", name, "-o", "%i"]).stdout.split() == []
    return r.stderr


# The refusals need no empty cluster (nothing runs), so they take the session cluster as it is.

def test_a_bad_value_fails_at_sbatch_naming_the_option(cluster):
    err = _refused(cluster, "--antman=opportunistic", "--antman-elastic=3:2", "--gres=gpu:2")
    assert "--antman-elastic: invalid value '3:2'" in err and "1 <= MIN <= MAX <= 64" in err


def test_a_guaranteed_job_is_refused_naming_the_rule(cluster):
    err = _refused(cluster, "--antman=guaranteed", "--antman-elastic=1:2", "--gres=gpu:2")
    assert "--antman-elastic is only for --antman=opportunistic or --antman=auto" in err, err


def test_max_must_equal_the_gpus_asked_for(cluster):
    err = _refused(cluster, "--antman=opportunistic", "--antman-elastic=1:3", "--gres=gpu:2")
    assert "--antman-elastic=1:3: MAX must equal the GPUs per node the job asks for, 2" in err, err


def test_an_elastic_opportunistic_job_is_accepted_tagged_and_sees_its_range(clean_cluster):
    c = clean_cluster
    jid = c.sbatch("--antman=opportunistic", "--antman-elastic=1:2", "--gres=gpu:2", script=SCRIPT)
    try:
        line = next(l for l in c.wait_output(jid, r"^ELASTIC=").splitlines() if l.startswith("ELASTIC="))
        seen = dict(kv.split("=", 1) for kv in line.split())
        info = c.show(jid)
        assert "elastic=1:2" in info["AdminComment"], info["AdminComment"]
        tag = parse_tag(info["AdminComment"])
        assert tag is not None and tag.job_class == "opportunistic" and tag.elastic == (1, 2)
        assert info["NumNodes"] == "1"
        # the env file's (the Prolog's, from the tag) and the job control env's (the plugin's)
        assert seen["ELASTIC"] == "1:2" and seen["SPANK"] == "1:2"
        assert len(seen["GPUS"].split(",")) == 2
    finally:
        c.run(["scancel", str(jid)])


# ---- across nodes: a job array of one-node tasks (docs/elastic.md, "Across nodes: a job array") ----
# job_submit.lua reads the task count and the throttle from job_desc.array_inx. What these check of it on
# the real 22.05 slurmctld: the string is the --array value as typed, the throttle ("%1") and the step
# (":2") included, and a refused array leaves no task behind.

def test_a_throttle_on_an_array_across_nodes_is_refused(cluster):
    err = _refused(cluster, "--antman=opportunistic", "--antman-elastic=2:4", "--gres=gpu:2", "--array=0-1%1")
    assert "--antman-elastic=2:4 with --array=0-1%1 (2 tasks) and --gres=gpu:2 per task: drop the throttle %1" in err, err


def test_a_max_that_fits_neither_reading_is_refused_naming_both(cluster):
    err = _refused(cluster, "--antman=opportunistic", "--antman-elastic=2:6", "--gres=gpu:2", "--array=0-3:2")
    assert ("--antman-elastic=2:6 with --array=0-3:2 (2 tasks) and --gres=gpu:2 per task: MAX must be 2 "
            "(each task its own elastic job) or 4 (one job across the 2 tasks' nodes, MIN a multiple of 2)") in err, err


def test_a_job_over_several_nodes_is_told_to_be_an_array(cluster):
    err = _refused(cluster, "--antman=opportunistic", "--antman-elastic=2:4", "--gres=gpu:2", "-N", "2")
    assert "--antman-elastic=2:4: an elastic job runs on one node; for one job across K nodes" in err, err
    assert "--array=0-(K-1)" in err


ARRAY_SCRIPT = """#!/bin/bash
echo "TASK=${SLURM_ARRAY_TASK_ID:-} ELASTIC=${ANTMAN_ELASTIC:-} SPANK=${SLURM_SPANK_ANTMAN_ELASTIC:-} GPUS=${ANTMAN_GPUS:-}"
sleep 30
"""


def test_an_array_across_nodes_is_accepted_and_each_task_sees_the_whole_range(clean_cluster):
    c = clean_cluster
    jid = c.sbatch("--antman=opportunistic", "--antman-elastic=2:4", "--gres=gpu:2", "--array=0-1",
                   "-o", str(c.workdir / "%A_%a.out"), script=ARRAY_SCRIPT)
    try:
        seen = {}
        for task in (0, 1):
            path = c.workdir / f"{jid}_{task}.out"
            line = wait_for(lambda: next((l for l in (path.read_text() if path.exists() else "").splitlines()
                                          if l.startswith("TASK=")), None), 60, f"task {task}'s output")
            seen[task] = dict(kv.split("=", 1) for kv in line.split())
        for task, env in seen.items():
            assert env["TASK"] == str(task)
            # the env file's range (the Prolog's, from the tag) is the whole job's, not this task's 2 GPUs
            assert env["ELASTIC"] == "2:4" and env["SPANK"] == "2:4", env
            assert len(env["GPUS"].split(",")) == 2, env
        lines = c.run(["scontrol", "show", "job", "-o", str(jid)]).stdout.splitlines()
        assert len(lines) == 2, lines
        for line in lines:
            info = dict(parse_scontrol_line(line))
            tag = parse_tag(info["AdminComment"])
            assert tag is not None and tag.job_class == "opportunistic" and tag.elastic == (2, 4), info["AdminComment"]
            assert info["NumNodes"] == "1" and info["ArrayJobId"] == str(jid)
            assert elastic_kind(tag.elastic, 2) == ACROSS_NODES
        # what slurmctld's job_submit/lua saw in job_desc.array_inx: the --array value as given
        log = (c.c.dir / "log" / "slurmctld.log").read_text(errors="replace")
        assert "elastic width 2 to 4 GPUs across the nodes of the 2 tasks of --array=0-1 (2 GPUs each)" in log
    finally:
        c.run(["scancel", str(jid)])
