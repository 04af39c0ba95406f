"""`antman bench simulate --from-sacct` on the devcluster: jobs run through Slurm, are read back from
slurmdbd with sacct, and are replayed on the cluster's own shape with its accounts' quotas
(docs/admin.md, "What would antman buy my cluster?")."""

from __future__ import annotations

import json
import sys
import time

import pytest

from slurm_antman import config
from slurm_antman.lab.devcluster.jobs import wait_for
from slurm_antman.lab.evaluation import sacct_trace

pytestmark = [pytest.mark.cluster]


def _done_in_the_window(c, since: str, ids: list[int]) -> bool:
    """Every job in ``ids`` ended, as the replay's own window query (``-S since -E now``) sees it.

    ``sacct -j`` is not enough: slurmdbd answers a query by id for every job it holds, but a window query
    only for jobs whose recorded eligible time falls in the window (Slurm 22.05,
    as_mysql_jobacct_process.c). On a busy devcluster a window query made right after ``sacct -j`` showed
    all four jobs COMPLETED found none (2026-11-29; the rows were last written a second after the jobs
    ended), so the test waits on the query the replay itself makes."""
    r = c.run(["sacct", "-n", "-X", "-P", "--allusers", "-S", since, "-E", "now", "-o", "JobIDRaw,State"])
    states = dict(line.split("|", 1) for line in r.stdout.split() if "|" in line)
    return all(states.get(str(i), "").startswith(("COMPLETED", "FAILED")) for i in ids)


def test_the_cluster_s_own_history_is_replayed_on_its_own_shape_and_quotas(clean_cluster, tmp_path):
    c = clean_cluster
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 1))
    gpu_jobs = {
        c.sbatch("--antman=guaranteed", "--gres=gpu:2", "-A", "research", wrap="sleep 2"): 2,
        c.sbatch("--antman=guaranteed", "--gres=gpu:1", "-A", "product", wrap="sleep 1"): 1,
        c.sbatch("--antman=opportunistic", "--gres=gpu:1", wrap="sleep 1"): 1,
    }
    cpu_only = c.sbatch(wrap="sleep 1")
    ids = [*gpu_jobs, cpu_only]
    wait_for(lambda: _done_in_the_window(c, since, ids) or None, 120, "the jobs to end in Slurm accounting's window")
    saved = tmp_path / "history.json"
    r = c.run([sys.executable, "-m", "slurm_antman.cli", "bench", "simulate", "--from-sacct", "--since", since,
               "--save-sacct", str(saved), "--shape-from-slurm", "--quotas-from-slurm",
               "--policy", "exclusive,antman", "--json", "--out", str(tmp_path / "out")], timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    meta = doc["meta"]
    # What sacct printed is kept, and reads back to exactly the jobs that ran on GPUs.
    replayed = {j.job_id: j for j in sacct_trace.load(saved)}
    assert {f"slurm-{i}": n for i, n in gpu_jobs.items()}.items() <= {k: j.gpus for k, j in replayed.items()}.items()
    assert f"slurm-{cpu_only}" not in replayed and meta["sacct_skipped"]["no_gpu"] >= 1
    assert meta["jobs"] == len(replayed)
    cfg = config.load(c.c.config_path)
    assert (meta["nodes"], meta["gpus_per_node"]) == (len(c.c.nodes), c.c.gpus)
    assert meta["quotas_from_slurm"] == {t.account: t.guaranteed_gpus for t in cfg.tenants}
    assert all(p["jobs_done"] == len(replayed) for p in doc["policies"].values())
    assert all(p["quotas"] == meta["quotas_from_slurm"] for p in doc["policies"].values())
    assert "Accounting holds no GPU utilisation or memory" in r.stderr
    # The results page names what the history left out and where the cluster's shape and quotas came from.
    page = (tmp_path / "out" / "report.md").read_text()
    assert f"{meta['sacct_skipped']['no_gpu']} no gpu" in page and "as `scontrol show nodes` shows it" in page
    assert f"`GrpTRES=gres/gpu=N` ({len(meta['quotas_from_slurm'])} accounts)" in page
    assert "that of the best Slurm policy replayed** (`exclusive`" in page
