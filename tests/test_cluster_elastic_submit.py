"""--antman-elastic=MIN:MAX on the session's real Slurm cluster (issue 29 part 3, docs/elastic.md),
submitted by the unprivileged submitter: the plugin refuses a bad value at sbatch, job_submit.lua
refuses a range that does not fit the job, and an accepted job carries the range in its tag and its
environment."""

from __future__ import annotations

import time

import pytest

from slurm_antman.jobtag import parse_tag

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
