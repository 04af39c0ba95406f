"""Shared fixtures: one real Slurm devcluster (slurmctld, 2 slurmd, sidecars) for the whole session."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest

from slurm_antman import devcluster as dc

TEST_PORT_BASE = int(os.environ.get("ANTMAN_TEST_PORT_BASE", "18417"))


def _require_slurm() -> None:
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "scontrol") if not (shutil.which(b) or Path(f"/usr/sbin/{b}").exists())]
    if missing:
        pytest.fail(f"Slurm is not installed ({', '.join(missing)} missing): run `make test`, which installs it")
    if os.geteuid() != 0:
        pytest.fail("the devcluster tests run slurmctld/slurmd and must run as root")


class ClusterHandle:
    """The devcluster plus the few Slurm calls the tests need, with back-off polling."""

    def __init__(self, cluster: dc.Cluster, workdir: Path):
        self.c = cluster
        self.workdir = workdir

    @property
    def env(self) -> dict[str, str]:
        return self.c.env

    def run(self, args, **kw):
        return self.c.run(args, **kw)

    def sbatch(self, *args: str, script: str | None = None, wrap: str | None = None, expect_ok: bool = True):
        argv = ["sbatch", "--parsable", "-D", str(self.workdir), "-o", str(self.workdir / "%j.out"), *args]
        if wrap is not None:
            argv += ["--wrap", wrap]
        if script is not None:
            path = self.workdir / f"script-{time.monotonic_ns()}.sh"
            path.write_text(script)
            argv.append(str(path))
        r = self.c.run(argv)
        if expect_ok:
            assert r.returncode == 0, f"sbatch failed: {r.stderr}"
            return int(r.stdout.strip().split(";")[0])
        return r

    def show(self, job_id: int) -> dict[str, str]:
        r = self.c.run(["scontrol", "show", "job", "-o", str(job_id)])
        assert r.returncode == 0, r.stderr
        return dict(m.groups() for m in re.finditer(r"(?:^|\s)([A-Za-z:/]+)=(\S*)", r.stdout))

    def wait_state(self, job_id: int, states: set[str], timeout: float = 60) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        delay = 0.2
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.show(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(delay)
            delay = min(delay * 1.5, 2.0)
        raise AssertionError(f"job {job_id} not in {states} after {timeout}s: {info.get('JobState')} "
                             f"{info.get('Reason')}")

    def wait_output(self, job_id: int, pattern: str, timeout: float = 30) -> str:
        path = self.workdir / f"{job_id}.out"
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = path.read_text() if path.exists() else ""
            if re.search(pattern, text, re.M):
                return text
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} output never matched {pattern!r}:\n{text}")

    def cancel_all(self) -> None:
        self.c.run(["scancel", "--user", "root"])


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> ClusterHandle:
    _require_slurm()
    d = tmp_path_factory.mktemp("devcluster")
    work = tmp_path_factory.mktemp("jobs")
    c = dc.up(d, nodes=2, gpus=4, cpus=4, port_base=TEST_PORT_BASE)
    try:
        yield ClusterHandle(c, work)
    finally:
        c.run(["scancel", "--user", "root"])
        dc.down(d)


@pytest.fixture
def clean_cluster(cluster: ClusterHandle) -> ClusterHandle:
    """The session cluster with no job left over from an earlier test."""
    cluster.cancel_all()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = cluster.run(["squeue", "-h", "-t", "PD,R,CG,S", "-o", "%i"])
        if r.returncode == 0 and not r.stdout.strip():
            break
        time.sleep(0.3)
    return cluster


PLAIN_PORT_BASE = TEST_PORT_BASE + 500


def drain(b, timeout: float = 20) -> None:
    """Cancel every job and wait for them to end, so no job step outlives the cluster."""
    from slurm_antman.slurm import JobNotFound, SlurmUnavailable

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
def backend(plain_cluster):
    from slurm_antman.slurm import CliBackend, CommandFailed, JobNotFound

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
