"""`antman devcluster up|status|down` as a user runs them: real processes, stopped by PID."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent


def _antman(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm_antman.cli", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent, the CLI, has exited and init reaps it).
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_up_twice_status_down_stops_only_its_processes(tmp_path):
    d = tmp_path / "dc"
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        r = _antman("devcluster", "up", "--dir", str(d), "--nodes", "2", "--gpus", "2", "--port-base", "18517")
        assert r.returncode == 0, r.stderr
        exports = dict(line.removeprefix("export ").split("=", 1) for line in r.stdout.splitlines())
        assert exports["SLURM_CONF"] == str(d.resolve() / "etc" / "slurm.conf")
        # What eval would give a shell works for plain Slurm commands.
        env = {**os.environ, **exports}
        sinfo = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %G"], capture_output=True, text=True, env=env)
        assert "node1 gpu:2,antman_opp:4" in sinfo.stdout and "node2" in sinfo.stdout

        st = json.loads(_antman("devcluster", "status", "--dir", str(d), "--json").stdout)
        assert st["running"] is True
        names = sorted(p["name"] for p in st["procs"])
        assert {"slurmctld", "slurmd:node1", "slurmd:node2", "sidecar:node1", "sidecar:node2"} <= set(names)
        pids = {p["name"]: p["pid"] for p in st["procs"]}

        # Each node once, though sinfo -N gives a line per node and partition.
        text = _antman("devcluster", "status", "--dir", str(d)).stdout
        assert [line.split()[0] for line in text.splitlines() if line.startswith("  node")] == ["node1", "node2"]
        assert len(st["nodes"]) == 2 and "(partitions gpu*,opportunistic)" in st["nodes"][0], st["nodes"]

        # `up` on the running cluster (the demo's, after --keep) says so and leaves it be; with flags it
        # was not started with, it refuses and names them.
        for args in (["--port-base", "18517"], []):
            again = _antman("devcluster", "up", "--dir", str(d), *args)
            assert again.returncode == 0 and again.stdout == r.stdout
            assert f"devcluster already running (left as it is) in {d.resolve()}" in again.stderr
        other = _antman("devcluster", "up", "--dir", str(d), "--nodes", "3")
        assert other.returncode == 1 and "nodes: running 2, asked 3" in other.stderr, other.stderr
        assert "antman devcluster down" in other.stderr
        st2 = json.loads(_antman("devcluster", "status", "--dir", str(d), "--json").stdout)
        assert {p["name"]: p["pid"] for p in st2["procs"]} == pids  # nothing restarted, nothing doubled

        down = _antman("devcluster", "down", "--dir", str(d))
        assert down.returncode == 0
        for name, pid in pids.items():
            if name != "munged":
                assert not _alive(pid), f"{name} ({pid}) still running after down"
        assert _alive(bystander.pid)
        st3 = _antman("devcluster", "status", "--dir", str(d))
        assert st3.returncode == 3 and "not running" in st3.stdout
    finally:
        bystander.kill()
        bystander.wait()
        _antman("devcluster", "down", "--dir", str(d))


def test_a_munged_in_a_chroot_is_not_ours_to_wait_for(tmp_path):
    """`devcluster up` waits for an exiting munged of its own before starting one; a munged in a
    chroot (make test-slurm24's) shares the PID namespace but not the socket, and must not count."""
    from slurm_antman.lab.devcluster.processes import _munged_pids_here

    # Two processes named munged: one in our root, one chrooted into an empty directory.
    code = ("import os, sys, time; open('/proc/self/comm', 'w').write('munged');"
            "root = sys.argv[1]; root and os.chroot(root); print('ready', flush=True); time.sleep(60)")
    jail = tmp_path / "jail"
    jail.mkdir()
    ours = subprocess.Popen([sys.executable, "-c", code, ""], stdout=subprocess.PIPE, text=True)
    jailed = subprocess.Popen([sys.executable, "-c", code, str(jail)], stdout=subprocess.PIPE, text=True)
    try:
        assert ours.stdout.readline().strip() == "ready"
        assert jailed.stdout.readline().strip() == "ready"
        found = _munged_pids_here()
        assert ours.pid in found
        assert jailed.pid not in found
    finally:
        for p in (ours, jailed):
            p.kill()
            p.wait()
