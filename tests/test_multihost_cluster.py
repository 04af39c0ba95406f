"""A cluster of hosts: every node in its own network namespace with its own address, the
controller, slurmdbd and the coordinator in another, joined by a bridge inside the cluster's own
namespaces. Every message between a node and the controller crosses a real interface."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_antman import config
from slurm_antman.lab.devcluster import cluster as dc
from slurm_antman.lab.devcluster.jobs import ClusterJobs

from conftest import TEST_PORT_BASE, _require_slurm

pytestmark = pytest.mark.cluster

PORT_BASE = TEST_PORT_BASE + 700
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    _require_slurm()
    d = tmp_path_factory.mktemp("hosts-cluster")
    c = dc.up(d, nodes=2, gpus=2, cpus=4, port_base=PORT_BASE, hosts=True)
    try:
        yield ClusterJobs(c, tmp_path_factory.mktemp("hosts-jobs"))
    finally:
        ClusterJobs(c, d / "jobs").cancel_all()
        dc.down(d)
    assert not any(Path("/run/netns", c.hosts.ns(h)).exists() for h in ["ctl", *c.hosts.nodes]), \
        "down left a network namespace behind"


def _tcp_peers(pid: int) -> set[tuple[str, int, str, int]]:
    """(local address, port, remote address, port) of the established IPv4 TCP connections in the
    network namespace of process ``pid`` (/proc/PID/net/tcp is that namespace's table)."""
    def addr(h: str) -> tuple[str, int]:
        ip, port = h.split(":")
        return ".".join(str(int(ip[i:i + 2], 16)) for i in (6, 4, 2, 0)), int(port, 16)

    out = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[3] == "01":  # ESTABLISHED
            out.add((*addr(f[1]), *addr(f[2])))
    return out


def test_nodes_are_hosts_with_their_own_addresses(hosts):
    c = hosts
    h = c.c.hosts
    r = c.run(["sinfo", "-h", "-N", "-o", "%N %o %T"])
    seen = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()}
    assert seen["node1"][0] == h.addr("node1") and seen["node2"][0] == h.addr("node2"), r.stdout
    # From the host's own network namespace the controller cannot be reached at all: only through
    # the cluster's namespaces.
    r = subprocess.run(["scontrol", "ping"], env=c.env, capture_output=True, text=True, timeout=60)
    assert "DOWN" in r.stdout or r.returncode != 0, r.stdout


def test_a_job_runs_on_a_node_host_and_its_sidecar_reports_across_the_bridge(hosts):
    c = hosts
    h = c.c.hosts
    jid = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-w", "node2", wrap=(
        f"echo GPUS=$ANTMAN_GPUS NODE=$SLURMD_NODENAME; {sys.executable} -c "
        f"\"import os; os.open('{c.c.dir}/dev/nvidia' + os.environ['ANTMAN_GPUS'], os.O_RDWR)\" 2>&1 | tail -1; "
        "echo PROBED; sleep 30"))
    text = c.wait_output(jid, r"^PROBED", timeout=60)
    assert "NODE=node2" in text and "No such device or address" in text, text  # its GPU, opened (ENXIO)
    # node2's sidecar holds a TCP connection from node2's address to the coordinator's, in node2's namespace.
    sidecar = next(p for p in c.c.procs if p.name == "sidecar:node2")
    endpoint = config.load(c.c.config_path).coordinator.endpoint
    assert endpoint.startswith(f"tcp://{h.addr('ctl')}:"), endpoint
    coord_port = int(endpoint.rsplit(":", 1)[1])
    peers = _tcp_peers(sidecar.pid)
    assert any(l == h.addr("node2") and r == h.addr("ctl") and rp == coord_port for l, _, r, rp in peers), peers
    # And what it reported arrived: the coordinator wrote where the job was placed.
    audit = c.c.dir / "log" / "coordinator-audit.jsonl"
    deadline = time.monotonic() + 30
    placed = []
    while time.monotonic() < deadline and not placed:
        placed = [json.loads(l) for l in audit.read_text().splitlines()
                  if '"placed"' in l and f'"{jid}"' in l] if audit.exists() else []
        time.sleep(0.5)
    assert placed and placed[0]["node"] == "node2", placed
    # Its user, on another host (node1's), sees its live state: asked of the coordinator across the
    # bridge, with a munge credential.
    env = dict(c.env, PYTHONPATH=str(REPO), HOME=f"/home/{c.c.user}")
    r = c.c.run([sys.executable, "-m", "slurm_antman.cli", "squeue", "--json"], host="node1", env=env,
                as_user=(c.uid, c.gid), cwd=c.workdir, timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    row = {x["job_id"]: x for x in json.loads(r.stdout)}[jid]
    assert row["live"] == "coordinator" and row["gpus"] == [int(text.split("GPUS=")[1].split()[0])], row
    c.run(["scancel", str(jid)])


def _doctor(c, node: str) -> dict:
    r = c.c.run([sys.executable, "-m", "slurm_antman.admin.doctor", "--node", node, "--json"], host=node,
                env=dict(c.env, PYTHONPATH=str(REPO)), timeout=60)
    return {x["name"]: x for x in json.loads(r.stdout)}


@pytest.mark.slurm_neutral  # the ZeroMQ link between hosts, not Slurm; 24.11 skips it (Makefile)
def test_doctor_on_a_node_checks_the_link_to_the_coordinator_and_names_the_port_to_open(hosts):
    c = hosts
    h = c.c.hosts
    link = _doctor(c, "node1")["coordinator_link"]
    assert link["status"] == "ok" and "CURVE handshake" in link["reason"], link
    h.link("node1", up=False)  # node1's cable out: as a firewall dropping its packets would
    try:
        link = _doctor(c, "node1")["coordinator_link"]
    finally:
        h.link("node1", up=True)
    assert link["status"] == "fail" and "cannot reach the coordinator" in link["reason"], link
    port = config.load(c.c.config_path).coordinator.endpoint.rsplit(":", 1)[1]
    assert f"{h.addr('ctl')} port {port}" in link["hint"], link
