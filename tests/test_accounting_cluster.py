"""Slurm accounting on the devcluster (docs/admin.md, "Tenant quotas"): slurmdbd on a real MariaDB, the
tenants as accounts with GrpTRES=gres/gpu=N, the coordinator taking its quotas from there, sacct
answering for every job (requeued ones included), and submitit, a real client that polls sacct, running
a job without one sacct error."""

from __future__ import annotations

import logging
import operator
import re

import pytest

from slurm_antman.lab.devcluster import accounting as acct
from slurm_antman.lab.devcluster.jobs import wait_for

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


def test_opportunistic_gpu_use_shows_in_sacct_and_sreport(clean_cluster):
    """AccountingStorageTRES lists gres/antman_opp (merged into the devcluster's slurm.conf as at a site), so
    an opportunistic job's slots are in its AllocTRES and in sreport. `sreport job SizesByAccount` reads the
    job records themselves; the cluster reports read the hourly rollup, which `sacctmgr roll START END` makes
    at once. sreport's periods are whole hours, and an end after now is cut back to the hour now is in
    (start=20:00 end=23:00 at 21:03 reports 20:00-20:59), so the report asks for exactly the job's hour."""
    import datetime
    import time

    c = clean_cluster
    # An account of this test's own, so that the reports' numbers are this job's alone.
    acct.sacctmgr(c.c, "-i", "add", "account", "acctprobe", "cluster=antmandev")
    acct.sacctmgr(c.c, "-i", "add", "user", c.c.user, "account=acctprobe", "cluster=antmandev")
    while time.localtime().tm_min == 59 and time.localtime().tm_sec >= 30:
        time.sleep(1)  # the job must start and end within one hour: the one the reports ask for
    opp = c.sbatch("--antman=opportunistic", "--gres=gpu:2", "-A", "acctprobe", wrap="sleep 4")
    g = c.sbatch("--antman=guaranteed", "--gres=gpu:1", "-A", "acctprobe", wrap="sleep 4")
    for j in (opp, g):
        c.wait_state(j, {"COMPLETED"}, timeout=90)

    def sacct():
        r = c.run(["sacct", "-n", "-P", "-X", "-j", f"{opp},{g}", "-o", "JobID,State,AllocTRES,ElapsedRaw,Start"])
        assert r.returncode == 0, r.stderr
        rows = {jid: (state, dict(kv.split("=", 1) for kv in tres.split(",") if kv), int(el), st)
                for jid, state, tres, el, st in (line.split("|") for line in r.stdout.splitlines())}
        return rows if all(rows.get(str(j), ("",))[0] == "COMPLETED" for j in (opp, g)) else None

    rows = wait_for(sacct, 30, "sacct to record both jobs done")
    _, opp_tres, opp_s, opp_start = rows[str(opp)]
    _, g_tres, _, _ = rows[str(g)]
    hour = datetime.datetime.fromisoformat(opp_start).replace(minute=0, second=0)
    start, end = hour.isoformat(), (hour + datetime.timedelta(hours=1)).isoformat()
    assert opp_tres.get("gres/antman_opp") == "2" and "gres/gpu" not in opp_tres, opp_tres
    assert g_tres.get("gres/gpu") == "1" and "gres/antman_opp" not in g_tres, g_tres
    assert opp_s >= 4

    def report(*args: str) -> dict[str, str]:
        r = c.run(["sreport", "-n", "-P", "-t", "seconds", "-T", "gres/antman_opp", *args, f"start={start}",
                   f"end={end}"], timeout=60)
        assert r.returncode == 0, r.stderr
        return {line.split("|")[1]: line for line in r.stdout.splitlines() if line.count("|") >= 3}

    # Job records, no rollup needed: 2 slots for the job's elapsed seconds, the guaranteed job adds none.
    sizes = wait_for(lambda: report("job", "SizesByAccount", "FlatView", "grouping=1").get("acctprobe"), 30,
                     "sreport job SizesByAccount to list the account")
    assert sizes.split("|")[3] == str(2 * opp_s), sizes
    # The cluster reports, from the hourly rollup, forced here.
    assert acct.sacctmgr(c.c, "-i", "roll", start, end).returncode == 0
    used = report("cluster", "AccountUtilizationByUser", "Accounts=acctprobe")
    assert used["acctprobe"].split("|")[-2:] == ["gres/antman_opp", str(2 * opp_s)], used
