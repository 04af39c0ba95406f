"""slurmd registers with slurmctld again (after its restart, as on a package upgrade, and about every 20
pings on its own): the node must stay in service then.

slurmctld checks each registration's count of a GRES against the count it found at the node's first
one, and while jobs hold that GRES a difference marks the node INVAL and drains it ("gres/antman_opp
count changed and jobs are using them"; src/interfaces/gres.c ``_node_config_validate``, the same from
22.05 to 26.05). A drained node takes no job at all, guaranteed ones included. So the coordinator leaves
the opportunistic count as slurm.conf has it (policy.cluster.placement), and puts back a count changed
by anyone else once no opportunistic job holds a slot there."""

from __future__ import annotations

import os
import signal
import time

import pytest

from slurm_antman import config
from slurm_antman import device_failure as df
from slurm_antman.lab.devcluster import cluster as dc
from slurm_antman.lab.devcluster.jobs import wait_for
from slurm_antman.slurm import CliBackend

pytestmark = [pytest.mark.cluster]

OPP = "antman_opp"


def _node(b: CliBackend, name: str):
    return next(n for n in b.nodes() if n.name == name)


def _configured(c, node: str) -> int:
    """The node's opportunistic count in the cluster's slurm.conf (its node lines are in the fragment
    slurm-antman renders, which slurm.conf includes)."""
    etc = c.c.dir / "etc"
    for line in ((etc / "slurm.conf").read_text() + (etc / "antman.slurm.conf").read_text()).splitlines():
        if line.startswith("NodeName=") and f"NodeName={node} " in line + " ":
            gres = next(f for f in line.split() if f.startswith("Gres="))
            return int(next(e for e in gres[5:].split(",") if e.startswith(OPP)).split(":")[-1])
    raise AssertionError(f"{node} not in slurm.conf")


def _restart_slurmd(c, node: str) -> float:
    old = next(p for p in c.c.procs if p.name == f"slurmd:{node}")
    os.kill(old.pid, signal.SIGTERM)
    wait_for(lambda: not old.alive() or None, 30, f"slurmd of {node} to stop")
    started = time.time()
    dc.replace_proc(c.c, dc.start_slurmd(c.c, node))
    return started


def _registered_since(c, node: str, since: float) -> bool:
    """slurmctld has taken a registration of ``node``'s slurmd started after ``since``."""
    r = c.run(["scontrol", "show", "node", node, "-o"])
    field = next((f for f in r.stdout.split() if f.startswith("SlurmdStartTime=")), "")
    if not field or field.endswith("=None"):
        return False
    t = time.mktime(time.strptime(field.split("=", 1)[1], "%Y-%m-%dT%H:%M:%S"))
    return t >= int(since)


def _kept_off_for_health(c) -> bool:
    """The coordinator has decided on node1 as unhealthy: a pending opportunistic job is kept off it."""
    audit = c.c.dir / "log" / "coordinator-audit.jsonl"
    return audit.exists() and "node1 takes no opportunistic job" in audit.read_text()


def test_the_count_stays_as_configured_and_a_slurmd_restart_under_running_jobs_drains_nothing(clean_cluster):
    c = clean_cluster
    b = CliBackend(env=c.env)
    configured = _configured(c, "node1")
    g = c.sbatch("--antman=guaranteed", "--gres=gpu:1", "-w", "node1", wrap="sleep 300")
    opp = [c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-w", "node1", wrap="sleep 300") for _ in range(2)]
    for j in (g, *opp):
        c.wait_state(j, {"RUNNING"}, timeout=90)
        # Placed by its Prolog (which writes the GPUs into AdminComment): the unhealthy node below must not
        # be what that Prolog finds, or it refuses the job, as it should.
        wait_for(lambda j=j: "gpus=" in c.show(j).get("AdminComment", "") or None, 60, f"job {j}'s placement")
    # The node loses its room under the running jobs: a failed device grant makes it unhealthy (what a
    # release before 2026-11-29 answered by lowering the count to the 2 slots in use).
    record = df.record(os.path.join(config.load(c.c.config_path).state_dir, "node1"), str(opp[0]),
                       "a device grant that failed (written by this test)")
    # A pending opportunistic job shows in the audit log when the coordinator has acted on it.
    later = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "--begin=now+600", wrap="true")
    try:
        wait_for(lambda: _kept_off_for_health(c) or None, 30, "the coordinator to keep a job off unhealthy node1")
        assert _node(b, "node1").gres[OPP] == configured
    finally:
        record.unlink()
        c.run(["scancel", str(later)])
    since = _restart_slurmd(c, "node1")
    wait_for(lambda: _registered_since(c, "node1", since) or None, 60, "node1's slurmd to register")
    n = _node(b, "node1")
    assert "DRAIN" not in n.state_flags and "INVALID_REG" not in n.state_flags, (n.state_flags, n.reason)
    assert all(c.show(j)["JobState"] == "RUNNING" for j in (g, *opp))
    g2 = c.sbatch("--antman=guaranteed", "--gres=gpu:1", "-w", "node1", wrap="sleep 2")
    c.wait_state(g2, {"RUNNING", "COMPLETED"}, timeout=60)


def test_a_count_changed_by_hand_is_put_back_once_no_job_holds_a_slot(clean_cluster):
    c = clean_cluster
    b = CliBackend(env=c.env)
    configured = _configured(c, "node2")
    gres = ",".join(e for e in str(_node(b, "node2").raw.get("gres") or "").split(",") if not e.startswith(OPP))
    b.update_node("node2", Gres=f"{gres},{OPP}:{configured - 2}")
    # As an earlier release left it: the coordinator puts it back within a few cycles.
    wait_for(lambda: _node(b, "node2").gres[OPP] == configured or None, 30,
             f"node2's {OPP} count to be put back to {configured}")
