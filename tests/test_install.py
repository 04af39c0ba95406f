"""`make install`, an upgrade with jobs running, and `make uninstall`, as a site does them: into a fresh
prefix (with the plugin, unit and bin directories under this test's own root, so nothing of the
machine's is touched), a devcluster running from the install (its daemons, hooks, plugin, Lua scripts
and agent bundle), then the upgrade from an earlier release to this checkout under running jobs, then
removal, after which the root holds exactly what it held before."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from slurm_antman.lab.devcluster import cluster as dc
from slurm_antman.lab.devcluster.jobs import ClusterJobs, wait_for

from conftest import TEST_PORT_BASE, let_jobs_through

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "slurm_antman" / "lab" / "jobs" / "demo_train.py"
# The release a site upgrades from: the first whose `make install` records all it creates. Raise it at each release
# whose upgrade path must be kept (the protocol's version rules are what make an older agent and a
# newer sidecar work together).
UPGRADE_FROM = os.environ.get("ANTMAN_UPGRADE_FROM", "09d9e5f2e3581264841bcdcdf035c937e5d8cda6")
PORT_BASE = TEST_PORT_BASE + 1100


def _make(target: str, src: Path, root: Path) -> subprocess.CompletedProcess:
    paths = _paths(root)
    r = subprocess.run(["make", "-s", "-C", str(src), target, *(f"{k}={v}" for k, v in paths.items())],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"make {target} in {src} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _paths(root: Path) -> dict[str, Path]:
    return {"PREFIX": root / "opt" / "slurm-antman", "BINDIR": root / "usr" / "local" / "bin",
            "UNIT_DIR": root / "usr" / "local" / "lib" / "systemd" / "system",
            "PLUGIN_DIR": root / "usr" / "lib" / "slurm"}


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _antman(c: ClusterJobs, prefix: Path, *args: str) -> subprocess.CompletedProcess:
    return c.c.run([str(prefix / "bin" / "antman"), *args], timeout=120)


def _live(c: ClusterJobs, prefix: Path) -> dict[int, dict]:
    r = _antman(c, prefix, "squeue", "--json")
    assert r.returncode == 0, r.stderr
    return {j["job_id"]: j for j in json.loads(r.stdout)}


def _wait_agents(c: ClusterJobs, prefix: Path, jobs: list[int], since: float = 0.0) -> dict[int, dict]:
    """Until each job's agent reports an iteration time to the (current) sidecar."""
    def ready():
        live = _live(c, prefix)
        return live if all(live.get(j, {}).get("iteration_ms") is not None for j in jobs) else None
    return wait_for(ready, 120, f"the agents of {jobs} reporting to their sidecar")


def _restart(cluster: dc.Cluster, name: str, start) -> None:
    """What `systemctl restart` does to a daemon: stop it, start it from the installed release."""
    old = next(p for p in cluster.procs if p.name == name)
    os.kill(old.pid, signal.SIGTERM)
    wait_for(lambda: not old.alive() or None, 30, f"{name} to stop")
    dc.replace_proc(cluster, start())


def test_install_upgrade_under_running_jobs_then_uninstall(tmp_path, torch_only_python):
    root = tmp_path / "root"
    root.mkdir()
    let_jobs_through(root)
    before = _tree(root)
    prefix = _paths(root)["PREFIX"]
    old_src = tmp_path / "old-src"
    old_src.mkdir()
    archive = subprocess.run(f"git -C {REPO} archive {UPGRADE_FROM} | tar -x -C {old_src}", shell=True,
                             capture_output=True, text=True)
    assert archive.returncode == 0, f"the upgrade baseline {UPGRADE_FROM} is not in this clone: {archive.stderr}"

    _make("install", old_src, root)
    first = json.loads((prefix / "share" / "slurm-antman" / "install.json").read_text())
    assert (prefix / "bin" / "antman").resolve().is_file()
    assert os.readlink(_paths(root)["BINDIR"] / "antman") == str(prefix / "bin" / "antman")
    unit = (_paths(root)["UNIT_DIR"] / "antman-sidecar.service").read_text()
    assert f"ExecStart={prefix}/bin/antman sidecar" in unit

    d = tmp_path / "cluster"
    let_jobs_through(d.parent)
    # Two GPUs a node: the opportunistic job gets its own, never kept off a busy guaranteed one
    cluster = dc.up(d, nodes=2, gpus=2, cpus=4, port_base=PORT_BASE, installed=prefix)
    c = ClusterJobs(cluster, tmp_path / "jobs")
    try:
        # The daemons run the installed release, not this checkout.
        for p in cluster.procs:
            if p.name.startswith(("sidecar", "coordinator")):
                cmd = Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")[0].decode()
                assert cmd.startswith(str(prefix / "releases" / first["release"])), (p.name, cmd)
        doctor = _antman(c, prefix, "doctor", "--json", "--node", "node1")
        checks = {ch["name"]: ch for ch in json.loads(doctor.stdout)}
        assert not {n: ch for n, ch in checks.items() if ch["status"] != "ok" and n != "nvml"}, checks

        # The jobs train until the test has seen what it checks: on a slow host (the cgroup v2 guest) the
        # install alone takes minutes, and a job of fixed length would end before the upgrade.
        stop = c.workdir / "stop"

        def script(name: str) -> str:
            return f"#!/bin/bash\nexec {torch_only_python} {TRAIN} {c.workdir / name} 100000 0.05 {stop}\n"
        g = c.sbatch("--antman=guaranteed", "--gres=gpu:1", "-w", "node1", script=script("g.ckpt"))
        o = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-w", "node1", script=script("o.ckpt"))
        _wait_agents(c, prefix, [g, o])

        # The upgrade, with both jobs running: install this checkout over the old release, restart
        # the daemons, put the new Lua scripts beside slurm.conf and reconfigure (docs/admin.md, "Upgrade").
        _make("install", REPO, root)
        second = json.loads((prefix / "share" / "slurm-antman" / "install.json").read_text())
        assert second["release"] != first["release"]
        assert sorted(os.listdir(prefix / "releases")) == sorted([first["release"], second["release"]])
        _restart(cluster, "coordinator", lambda: dc.start_coordinator(cluster))
        for node in cluster.nodes:
            _restart(cluster, f"sidecar:{node}", lambda node=node: dc.start_sidecar(cluster, node))
        for p in cluster.procs:
            if p.name.startswith(("sidecar", "coordinator")):
                cmd = Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")[0].decode()
                assert cmd.startswith(str(prefix / "releases" / second["release"])), (p.name, cmd)
        for lua in (prefix / "share" / "slurm-antman" / "lua").glob("*.lua"):
            (d / "etc" / lua.name).write_bytes(lua.read_bytes())
        assert c.c.run(["scontrol", "reconfigure"]).returncode == 0

        # The jobs started under the old release report to the new sidecar; a new job starts under the new one.
        o2 = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "-w", "node2", script=script("o2.ckpt"))
        live = _wait_agents(c, prefix, [g, o, o2])
        assert live[g]["class"] == "guaranteed" and live[o]["class"] == "opportunistic"
        stop.touch()
        # Nothing lost: every job ends COMPLETED, exit 0, the guaranteed one never requeued.
        for j in (g, o, o2):
            info = c.wait_state(j, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"},
                                timeout=400)
            assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (j, info, c.output(j)[-1500:])
        assert c.show(g)["Restarts"] == "0"
        doctor = _antman(c, prefix, "doctor", "--json", "--node", "node1")
        checks = {ch["name"]: ch for ch in json.loads(doctor.stdout)}
        assert not {n: ch for n, ch in checks.items() if ch["status"] != "ok" and n != "nvml"}, checks
    finally:
        c.cancel_all()
        dc.down(d)

    # Rollback: back to the earlier release (the command everyone runs is its), its agent bundle rebuilt.
    _make("rollback", REPO, root)
    assert os.readlink(prefix / "current") == f"releases/{first['release']}"
    assert str((prefix / "bin" / "antman").resolve()).startswith(str(prefix / "releases" / first["release"]))
    assert (prefix / "agent" / "sitecustomize.py").is_file()

    r = _make("uninstall", REPO, root)
    assert "left:" not in r.stdout, r.stdout
    assert _tree(root) == before, sorted(_tree(root) - before)
