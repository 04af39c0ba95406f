"""Slurm accounting on the devcluster (issue 17): slurmdbd on a real MariaDB, the tenants as accounts
with GrpTRES=gres/gpu=N, the coordinator taking its quotas from there, sacct answering for every job
(requeued ones included), and submitit, a real client that polls sacct, running a job without one
sacct error."""

from __future__ import annotations

import logging
import operator
import re

import pytest

from slurm_antman import devcluster_accounting as acct
from slurm_antman.devcluster_jobs import wait_for

pytestmark = pytest.mark.cluster


def _assocs(c) -> dict[str, str]:
    r = acct.sacctmgr(c.c, "-n", "-P", "show", "associations", "format=Account,User,GrpTRES", "cluster=antmandev")
    return {a: tres for a, user, tres in (line.split("|")[:3] for line in r.stdout.splitlines()) if not user}


def _quota_lua(c) -> str:
    return (c.c.dir / "etc" / "antman_quota.lua").read_text()


def test_tenants_are_accounts_with_a_gpu_limit_and_the_coordinator_follows_accounting(clean_cluster):
    c = clean_cluster
    assert _assocs(c)["research"] == "gres/gpu=4" and _assocs(c)["product"] == "gres/gpu=4"
    try:
        # An admin lowers a tenant's quota the way every Slurm site does it: in accounting.
        acct.sacctmgr(c.c, "-i", "modify", "account", "where", "name=product", "cluster=antmandev",
                      "set", "GrpTRES=gres/gpu=1")
        wait_for(lambda: '["product"] = { quota = 1,' in _quota_lua(c), 30,
                 "the coordinator's quota file to show accounting's new quota")
        assert '["research"] = { quota = 4,' in _quota_lua(c)
        log = (c.c.dir / "log" / "coordinator.log").read_text()
        assert "tenant quotas from Slurm accounting" in log
        # The new quota is enforced: with one GPU held, a second auto job of the tenant runs opportunistic.
        first = c.sbatch("--antman=auto", "--gres=gpu:1", "-A", "product", wrap="sleep 300")
        c.wait_state(first, {"RUNNING"})
        wait_for(lambda: '["product"] = { quota = 1, used = 1 }' in _quota_lua(c), 30, "product's use in the quota file")
        second = c.sbatch("--antman=auto", "--gres=gpu:1", "-A", "product", wrap="sleep 300")
        c.wait_state(second, {"RUNNING"}, timeout=60)
        assert c.show(first)["AdminComment"].startswith("antman:class=guaranteed;req=auto")
        assert c.show(second)["AdminComment"].startswith("antman:class=opportunistic;req=auto")
    finally:
        acct.sacctmgr(c.c, "-i", "modify", "account", "where", "name=product", "cluster=antmandev",
                      "set", "GrpTRES=gres/gpu=4")
        c.cancel_all()


def test_sacct_answers_for_a_requeued_job_with_each_of_its_runs(clean_cluster):
    c = clean_cluster
    job = c.sbatch("--requeue", wrap="sleep 300")
    c.wait_state(job, {"RUNNING"})
    assert c.run(["scontrol", "requeue", str(job)]).returncode == 0
    wait_for(lambda: c.show(job).get("Restarts") == "1" or None, 30, "the requeue")

    def runs():
        r = c.run(["sacct", "-n", "-P", "-D", "-X", "-j", str(job), "-o", "JobID,State"])
        assert r.returncode == 0, r.stderr
        return [line.split("|") for line in r.stdout.splitlines()]
    # -D: every run of the job, the requeued one with its own record
    rows = wait_for(lambda: (lambda x: x if any(s == "REQUEUED" for _, s in x) else None)(runs()), 30,
                    "sacct to record the requeue")
    assert {jid for jid, _ in rows} == {str(job)}
    c.cancel_all()


def test_submitit_polls_sacct_without_an_error(clean_cluster, tmp_path, monkeypatch, caplog):
    submitit = pytest.importorskip("submitit")
    c = clean_cluster
    for k, v in c.c.exports().items():
        monkeypatch.setenv(k, v)
    ex = submitit.SlurmExecutor(folder=tmp_path / "submitit", max_num_timeout=0)
    ex.update_parameters(time=5, cpus_per_task=1, mem="100M")
    with caplog.at_level(logging.WARNING):
        job = ex.submit(operator.add, 2, 3)
        assert job.result() == 5
        # submitit reads a job's state from sacct only (and caches it): asked afresh, sacct has it done
        wait_for(lambda: job.get_info(mode="force").get("State") == "COMPLETED" or None, 30,
                 "sacct, through submitit, to report the job COMPLETED")
    assert not [r for r in caplog.records if re.search(r"sacct", r.getMessage(), re.I)], caplog.text
