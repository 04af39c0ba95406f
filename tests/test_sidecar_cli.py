"""``antman sidecar`` as a real process: start, serve, stop on SIGTERM; clear errors on bad input."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import yaml

from slurm_antman.clients import sidecar_control as client

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = {"nodes": [{"name": "node[1-2]", "gpus": 2, "gpu_memory_mb": 8192}],
          "sidecar": {"heartbeat_s": 0.5}}


@pytest.fixture
def workdir():
    d = tempfile.mkdtemp(prefix="amc-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _write(d: str, data) -> str:
    path = os.path.join(d, "antman.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return path


def _run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm_antman.sidecar.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_serves_and_stops_on_sigterm(workdir):
    sock = os.path.join(workdir, "s")
    proc = subprocess.Popen([sys.executable, "-m", "slurm_antman.sidecar.cli", "--config", _write(workdir, CONFIG),
                             "--node", "node2", "--socket-dir", sock, "--telemetry", "emulated"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping(sock, timeout_s=0.5)
                break
            except client.SidecarUnreachable:
                assert proc.poll() is None and time.monotonic() < deadline, "sidecar did not come up"
                time.sleep(0.1)
        st = client.node_state(sock)
        assert (st.node, st.telemetry, len(st.gpus)) == ("node2", "emulated", 2)
        r = client.register_job(sock, "77", uid=0, user="root", job_class="opportunistic", gpus=1)
        assert os.path.exists(r.endpoint[len("ipc://"):])
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    assert "EMULATED" in out and "stopped" in out
    # Job records survive a stop so the next sidecar rebinds the job.
    assert os.path.exists(os.path.join(sock, "state", "77.json"))


def test_bad_config_names_the_field(workdir):
    bad = dict(CONFIG, sidecar={"heartbeat_s": -1})
    r = _run("--config", _write(workdir, bad), "--node", "node1", "--socket-dir", workdir)
    assert r.returncode == 2 and "sidecar.heartbeat_s" in r.stderr


def test_unknown_node_is_refused(workdir):
    r = _run("--config", _write(workdir, CONFIG), "--node", "gpu99", "--socket-dir", workdir,
             "--telemetry", "emulated")
    assert r.returncode == 2 and "'gpu99' is not listed" in r.stderr and "node1" in r.stderr


def test_bad_telemetry_flag():
    r = _run("--config", "x.yaml", "--telemetry", "magic")
    assert r.returncode == 2 and "invalid choice: 'magic'" in r.stderr
