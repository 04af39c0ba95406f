"""Shared fixtures: one real Slurm devcluster (slurmctld, 2 slurmd, sidecars) for the whole session."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from slurm_antman.lab.devcluster import cluster as dc
from slurm_antman.lab.devcluster.jobs import ClusterJobs

TEST_PORT_BASE = int(os.environ.get("ANTMAN_TEST_PORT_BASE", "18417"))


def _require_slurm() -> None:
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "scontrol") if not (shutil.which(b) or Path(f"/usr/sbin/{b}").exists())]
    if missing:
        pytest.fail(f"Slurm is not installed ({', '.join(missing)} missing): run `make test`, which installs it")
    if os.geteuid() != 0:
        pytest.fail("the devcluster tests run slurmctld/slurmd and must run as root")


# The tests' name for the devcluster plus its job calls (slurm_antman.lab.devcluster.jobs, shared with
# `antman bench faults`).
ClusterHandle = ClusterJobs


let_jobs_through = dc.let_users_through


@pytest.fixture(autouse=True)
def _tmp_path_for_jobs(request):
    """A test's tmp_path holds files its jobs read and write (scripts, flag files, checkpoints): the
    job's user may enter it and write there, as in a user's own directory on a cluster file system."""
    if "tmp_path" in request.fixturenames:
        path = request.getfixturevalue("tmp_path")
        let_jobs_through(path)
        try:
            pw = pwd.getpwnam(dc.DEV_USER)
        except KeyError:
            return  # no cluster made the user yet: no job of it will run here
        os.chown(path, pw.pw_uid, pw.pw_gid)


@contextlib.contextmanager
def managed_cluster(d: Path, work: Path, **up_args) -> Iterator[ClusterHandle]:
    """A devcluster in ``d`` (``dc.up(d, **up_args)``) whose jobs may enter ``d``, handed out with its
    jobs' directory ``work``; on the way out every job is cancelled and the cluster taken down."""
    _require_slurm()
    let_jobs_through(d)
    c = dc.up(d, **up_args)
    try:
        yield ClusterHandle(c, work)
    finally:
        ClusterHandle(c, work).cancel_all()
        dc.down(d)


@pytest.fixture
def agent_peer(tmp_path):
    """A peer sidecar (``lab.bench.control.PeerSidecar``, heartbeat 0.1 s) serving job 42's agent socket,
    under a short path in /tmp: a Unix socket's path may not be longer than 107 bytes."""
    from slurm_antman.lab.bench.control import PeerSidecar

    short = f"/tmp/antman-peer-{os.getpid()}-{tmp_path.name[-12:]}"
    os.makedirs(short, exist_ok=True)
    p = PeerSidecar(os.path.join(short, "jobs", "42", "agent.sock"), heartbeat_s=0.1).start()
    yield p
    p.stop()
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> ClusterHandle:
    with managed_cluster(tmp_path_factory.mktemp("devcluster"), tmp_path_factory.mktemp("jobs"),
                         nodes=2, gpus=4, cpus=4, port_base=TEST_PORT_BASE) as c:
        yield c


@pytest.fixture
def clean_cluster(cluster: ClusterHandle) -> ClusterHandle:
    """The session cluster with no job left over from an earlier test."""
    cluster.cancel_all()
    cluster.wait_empty(30)
    return cluster


PLAIN_PORT_BASE = TEST_PORT_BASE + 500


def drain(b, timeout: float = 20) -> None:
    """Cancel every job and wait for them to end, so no job step outlives the cluster."""
    from slurm_antman.slurm import CommandFailed, JobNotFound, SlurmUnavailable

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            active = [j for j in b.jobs() if not j.finished]
        except SlurmUnavailable:
            return
        if not active:
            return
        for j in active:
            try:
                b.cancel(j.job_id)
            except JobNotFound:
                pass
            except CommandFailed as e:
                # It ended between the listing and the cancel: nothing left to drain.
                if "already completing or completed" not in str(e):
                    raise
        time.sleep(0.5)


@pytest.fixture(scope="session")
def plain_cluster(tmp_path_factory):
    """A 2-node, 4-fake-GPU plain Slurm cluster (no slurm-antman stack) for the Slurm adapter tests."""
    from slurm_antman.slurm import CliBackend

    _require_slurm()
    d = tmp_path_factory.mktemp("slurm-plain-cluster")
    try:
        cluster = dc.up(d, nodes=2, gpus=4, port_base=PLAIN_PORT_BASE, plain=True)
        yield cluster
        drain(CliBackend(env=cluster.env, timeout=30))
    finally:
        dc.down(d)


@pytest.fixture
def backend(plain_cluster, tmp_path, monkeypatch):
    from slurm_antman.slurm import CliBackend, CommandFailed, JobNotFound

    # sbatch without -o puts slurm-N.out in the submitter's directory: keep it out of the checkout.
    monkeypatch.chdir(tmp_path)
    b = CliBackend(env=plain_cluster.env, timeout=30)
    yield b
    for j in b.jobs():
        if not j.finished:
            try:
                b.cancel(j.job_id)
            except JobNotFound:
                pass
            except CommandFailed as e:
                # It ended between the listing and the cancel: nothing left to clean up.
                if "already completing or completed" not in str(e):
                    raise


def _make_torch_only_venv(venv: Path) -> None:
    """A venv holding torch and what torch requires, file for file as this venv's pip installed them
    (dist RECORDs; hard links where the file system allows): no pip run, no index, no network, so the
    same works in make test-slurm24's chroot."""
    import re
    import subprocess
    from importlib import metadata

    from packaging.requirements import Requirement

    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    todo, seen = ["torch"], set()
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        dist = metadata.distribution(name)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        for f in dist.files or []:
            if f.parts[0] == ".." or "__pycache__" in f.parts:
                continue  # console scripts (bin/) and byte code: not needed to import torch
            src, dst = Path(dist.locate_file(f)), site / f
            if not src.is_file():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)


@pytest.fixture(scope="session")
def torch_only_python() -> Path:
    """The python of a venv with torch and nothing else: a user's own environment, which has never
    heard of slurm-antman or pyzmq. Made once per checkout and torch version beside this checkout's
    venv (the cluster's unprivileged user can run it; make test-slurm24's chroot sees it too)."""
    import subprocess

    import torch

    version = torch.__version__.split("+")[0]
    venv = Path(__file__).resolve().parent.parent / f".venv-torch-only-{version}"
    python = venv / "bin" / "python"
    if not (venv / ".complete").exists():
        shutil.rmtree(venv, ignore_errors=True)
        _make_torch_only_venv(venv)
        (venv / ".complete").touch()
    probe = subprocess.run([str(python), "-c", "import importlib.util as u, torch; print([m for m in ('zmq', "
                            "'slurm_antman', 'torch_patch', 'pydantic', 'pip') if u.find_spec(m)])"],
                           capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, cwd="/")
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", \
        f"{venv} is not a working torch-only venv: {probe.stdout} {probe.stderr[-2000:]}"
    let_jobs_through(venv)
    return python


@pytest.fixture(scope="session")
def carried_bundle(tmp_path_factory) -> Path:
    """The carried Slurm of `make gpu-site-bundle` (lab/devcluster/carried_slurm.py), built once per run from
    this machine's Debian packages (downloaded once into /var/cache/slurm-antman/carried-slurm)."""
    _require_slurm()
    from slurm_antman.lab.devcluster import carried_slurm

    out = tmp_path_factory.mktemp("carried") / "slurm"
    r = subprocess.run([sys.executable, "-m", "slurm_antman.lab.devcluster.carried_slurm", "build", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "manifest.json").exists() and carried_slurm.bundle_bytes(out) > 0
    return out
