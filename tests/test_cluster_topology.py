"""Locality on the real path (docs/admin.md, "Network locality"), on a real 4-node Slurm cluster with
two emulated leaf switches (``up(switches=2)``: s0 over node1,node2 and s1 over node3,node4, joined by
``top``; topology/tree).

What job_submit.lua asks of Slurm for an opportunistic job, and what Slurm 22.05 (and 24.11) does with it:
the job goes under one leaf switch when one has the nodes free, waits up to ``opportunistic.switch_wait_s``
when none has (Slurm's Reason reads Resources), then runs across; a guaranteed job, and an opportunistic
one that names nodes under two switches, ask nothing and Slurm places them at once. A job whose GPUs
fit on one node is kept on one (Slurm itself would spread ``--gres=gpu:2 -n 2`` over two nodes that each
have a CPU free, 2 GPUs on each). Every placement is read back from Slurm: ``scontrol show topology`` for
the switches, ``scontrol show job -d`` for the nodes and each node's GRES.

Nodes are taken away from a job with plain jobs that hold them (``--exclusive``, or 3 of a node's 4 CPUs)
in the guaranteed partition, which an opportunistic job cannot preempt.
"""

from __future__ import annotations

import re
import time
from datetime import datetime

import pytest

from conftest import TEST_PORT_BASE, ClusterHandle, managed_cluster
from slurm_antman import hostlist
from slurm_antman.lab.devcluster.files import switch_groups, topology_conf
from slurm_antman.lab.devcluster.processes import DevclusterError



def on_cluster(test):
    """Every test but the first starts or uses the 4-node cluster: about a minute in all, so they run
    in `make test-slow` (CI runs it too), keeping `make test` under its 15 minutes."""
    return pytest.mark.slow(pytest.mark.cluster(test))

PORT_BASE = TEST_PORT_BASE + 1500
SWITCH_WAIT_S = 12  # opportunistic.switch_wait_s here: long enough to see the job wait, short for a test
SWITCHES = f"1@00:00:{SWITCH_WAIT_S:02d}"  # as scontrol shows --switches=1@TIME


@pytest.fixture(scope="module")
def topo_cluster(tmp_path_factory):
    # No accounting and no coordinator: placement is Slurm's, and the opportunistic GRES counts the render
    # wrote are all it needs (the coordinator would only change them as GPUs fill).
    with managed_cluster(tmp_path_factory.mktemp("topology-cluster"), tmp_path_factory.mktemp("topology-jobs"),
                         nodes=4, gpus=4, cpus=4, port_base=PORT_BASE, accounting=False, coordinator=False,
                         switches=2, overrides={"opportunistic": {"switch_wait_s": SWITCH_WAIT_S}}) as c:
        yield c


@pytest.fixture
def clean(topo_cluster: ClusterHandle) -> ClusterHandle:
    topo_cluster.cancel_all()
    assert topo_cluster.wait_empty(30)
    return topo_cluster


def leaf_switches(c: ClusterHandle) -> dict[str, str]:
    """Each node's leaf switch, as Slurm read topology.conf (``scontrol show topology``, Level=0 lines)."""
    r = c.run(["scontrol", "show", "topology"], check=True)
    leaf = {}
    for line in r.stdout.splitlines():
        kv = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if kv.get("Level") == "0":
            for n in hostlist.expand(kv["Nodes"]):
                leaf[n] = kv["SwitchName"]
    return leaf


def nodes_of(info: dict[str, str]) -> list[str]:
    return hostlist.expand(info["NodeList"])


GRES_RE = re.compile(r"^\s*Nodes=(\S+) CPU_IDs=\S+ Mem=\S+ GRES=(\S*)", re.M)


def gres_by_node(c: ClusterHandle, job: int) -> dict[str, str]:
    """Each allocated node's GRES from ``scontrol show job -d``: {'node2': 'antman_opp(CNT:2)'}."""
    out = c.run(["scontrol", "show", "job", "-d", str(job)], check=True).stdout
    return {n: gres for nodes, gres in GRES_RE.findall(out) for n in hostlist.expand(nodes)}


def waited_s(info: dict[str, str]) -> float:
    return (datetime.fromisoformat(info["StartTime"]) - datetime.fromisoformat(info["SubmitTime"])).total_seconds()


def hold(c: ClusterHandle, nodes: list[str], *how: str) -> dict[str, int]:
    """A plain job on each of ``nodes`` that keeps it (or, with ``how``, part of it) from other jobs; once
    they all run."""
    jobs = {n: c.sbatch("-p", "gpu", "-w", n, *(how or ("--exclusive",)), wrap="sleep 600") for n in nodes}
    for j in jobs.values():
        c.wait_state(j, {"RUNNING"}, timeout=30)
    return jobs


def evaluated(c: ClusterHandle, job: int, timeout: float = 15) -> dict[str, str]:
    """The pending job once the scheduler has looked at it (its Reason is no longer None)."""
    deadline = time.monotonic() + timeout
    while True:
        info = c.show(job)
        if info["JobState"] != "PENDING" or info["Reason"] != "None" or time.monotonic() > deadline:
            return info
        time.sleep(0.3)


def idle_nodes(c: ClusterHandle) -> set[str]:
    r = c.run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], check=True)
    return set(r.stdout.split())


def test_topology_conf_puts_runs_of_nodes_under_each_leaf():
    nodes = [f"node{i}" for i in range(1, 6)]
    assert switch_groups(nodes, 2) == {"s0": ["node1", "node2", "node3"], "s1": ["node4", "node5"]}
    assert topology_conf(nodes[:4], 2).splitlines()[1:] == [
        "SwitchName=s0 Nodes=node1,node2", "SwitchName=s1 Nodes=node3,node4", "SwitchName=top Switches=s0,s1"]
    assert topology_conf(nodes[:2], 1).splitlines()[1:] == ["SwitchName=s0 Nodes=node1,node2"]  # no top
    for bad in (0, 6):
        with pytest.raises(DevclusterError, match="--switches"):
            switch_groups(nodes, bad)


@on_cluster
def test_slurm_reads_two_leaf_switches(topo_cluster):
    c = topo_cluster
    assert "TopologyPlugin=topology/tree" in c.c.slurm_conf.read_text().splitlines()
    assert leaf_switches(c) == {"node1": "s0", "node2": "s0", "node3": "s1", "node4": "s1"}
    top = c.run(["scontrol", "show", "topology", "top"], check=True).stdout
    assert "Level=1" in top and "Switches=s0,s1" in top


@on_cluster
def test_a_two_node_opportunistic_job_runs_under_one_switch_at_once(clean):
    c = clean
    hold(c, ["node1"])
    # Free: node2 (s0), node3 and node4 (s1). Taken in order, as without a topology, node2 and node3
    # would do, across the switches; the one switch with two free nodes is s1.
    j = c.sbatch("--antman=opportunistic", "-N", "2", "--gres=gpu:1", wrap="sleep 600")
    info = c.wait_state(j, {"RUNNING"}, timeout=30)
    assert info["Switches"] == SWITCHES
    assert nodes_of(info) == ["node3", "node4"], info["NodeList"]
    assert {leaf_switches(c)[n] for n in nodes_of(info)} == {"s1"}
    assert waited_s(info) < SWITCH_WAIT_S  # nothing to wait for
    assert gres_by_node(c, j) == {"node3": "antman_opp(CNT:1)", "node4": "antman_opp(CNT:1)"}


@on_cluster
def test_with_one_free_node_per_switch_it_waits_the_switch_wait_then_runs_across(clean):
    c = clean
    hold(c, ["node1", "node3"])
    # A guaranteed job asks for no switch and runs at once, across (its placement is Slurm's own).
    g = c.sbatch("--antman=guaranteed", "-N", "2", "--gres=gpu:1", wrap="sleep 600")
    info = c.wait_state(g, {"RUNNING"}, timeout=30)
    assert "Switches" not in info, info
    assert nodes_of(info) == ["node2", "node4"]
    c.run(["scancel", str(g)], check=True)
    c.wait_state(g, {"CANCELLED", "COMPLETED"}, timeout=30)
    for _ in range(60):  # its nodes come back once its Epilog ran
        if {"node2", "node4"} <= idle_nodes(c):
            break
        time.sleep(0.5)

    j = c.sbatch("--antman=opportunistic", "-N", "2", "--gres=gpu:1", wrap="sleep 600")
    info = evaluated(c, j)
    # Two nodes it could run on are idle, one under each switch: it waits for one switch. Slurm 22.05
    # gives no reason of its own for that wait: it reads Resources.
    assert (info["JobState"], info["Reason"], info["Switches"]) == ("PENDING", "Resources", SWITCHES), info
    assert {"node2", "node4"} <= idle_nodes(c)
    info = c.wait_state(j, {"RUNNING"}, timeout=SWITCH_WAIT_S + 60)
    assert nodes_of(info) == ["node2", "node4"]
    assert waited_s(info) >= SWITCH_WAIT_S - 1  # whole seconds on both ends
    assert info["Switches"] == SWITCHES


@on_cluster
def test_a_job_naming_nodes_under_two_switches_runs_there_at_once(clean):
    """-w node1,node4 asks for no switch: under two switches, it would wait the whole wait for nothing."""
    c = clean
    j = c.sbatch("--antman=opportunistic", "-w", "node1,node4", "--gres=gpu:1", wrap="sleep 600")
    info = c.wait_state(j, {"RUNNING"}, timeout=30)
    assert "Switches" not in info, info
    assert nodes_of(info) == ["node1", "node4"]
    assert waited_s(info) < SWITCH_WAIT_S


@on_cluster
def test_a_multi_gpu_opportunistic_job_stays_on_one_node(clean):
    c = clean
    # --gpus=2 (GPUs of the whole job): two slots on one node.
    j = c.sbatch("--antman=opportunistic", "--gpus=2", wrap="sleep 600")
    info = c.wait_state(j, {"RUNNING"}, timeout=30)
    assert len(nodes_of(info)) == 1 and gres_by_node(c, j) == {nodes_of(info)[0]: "antman_opp(CNT:2)"}
    c.cancel_all()
    assert c.wait_empty(30)

    # Every node with one CPU free: Slurm places --gres=gpu:2 -n 2 on two nodes, 2 GPUs on each (the
    # guaranteed job shows it, its placement left to Slurm)...
    holders = hold(c, ["node1", "node2", "node3", "node4"], "-n", "3")
    g = c.sbatch("--antman=guaranteed", "--gres=gpu:2", "-n", "2", wrap="sleep 600")
    info = c.wait_state(g, {"RUNNING"}, timeout=30)
    per_node = gres_by_node(c, g)
    assert len(per_node) == 2 and all(v.startswith("gpu:2(") for v in per_node.values()), per_node
    c.run(["scancel", str(g)], check=True)
    c.wait_state(g, {"CANCELLED", "COMPLETED"}, timeout=30)

    # ...the opportunistic job waits for one node with two CPUs free, and runs there.
    o = c.sbatch("--antman=opportunistic", "--gres=gpu:2", "-n", "2", wrap="sleep 600")
    info = evaluated(c, o)
    assert (info["JobState"], info["Reason"]) == ("PENDING", "Resources"), info
    assert info["NumNodes"] == "1-1"  # max_nodes=1, from job_submit.lua
    c.run(["scancel", str(holders["node3"])], check=True)
    info = c.wait_state(o, {"RUNNING"}, timeout=60)
    assert nodes_of(info) == ["node3"]
    assert gres_by_node(c, o) == {"node3": "antman_opp(CNT:2)"}
