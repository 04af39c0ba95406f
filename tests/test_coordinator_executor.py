"""The coordinator's executor against the real devcluster: decisions Slurm 22.05 cannot carry out
consistently are refused, never half done."""

from __future__ import annotations

import pytest

from slurm_antman import config
from slurm_antman.coordinator.executor import Executor
from slurm_antman.jobtag import parse_tag
from slurm_antman.policy.decisions import SetClass
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
