"""The systemd units in etc/systemd, and the SIGHUP reload they rely on (ExecReload=kill -HUP), done
to real daemon processes: a new valid antman.yaml applies without dropping jobs, an invalid one is
rejected with a log line and the running configuration kept."""

from __future__ import annotations

import configparser
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
import zmq

from slurm_antman import config as cfgmod
from slurm_antman import protocol as p
from slurm_antman.coordinator.daemon import Coordinator
from slurm_antman.slurm import CliBackend
from slurm_antman.clients import sidecar_control as client

REPO = Path(__file__).resolve().parent.parent
UNITS = REPO / "etc" / "systemd"


def unit(name: str) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # systemd keys are case-sensitive
    cp.read(UNITS / name)
    return cp


@pytest.mark.parametrize("name", ["antman-sidecar.service", "antman-coordinator.service"])
def test_unit_keys(name):
    u = unit(name)
    s = u["Service"]
    assert s["Restart"] == "on-failure"
    assert s["RestartSec"].rstrip("s").isdigit() and 1 <= int(s["RestartSec"].rstrip("s")) <= 30
    assert s["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert s["NoNewPrivileges"] == "yes" and s["ProtectSystem"] == "strict"
    assert u["Install"]["WantedBy"] == "multi-user.target"
    what = "sidecar" if "sidecar" in name else "coordinator"
    assert s["ExecStart"].split()[1] == what and "--config" in s["ExecStart"]


def test_sidecar_runs_as_root_and_coordinator_does_not():
    sc, co = unit("antman-sidecar.service")["Service"], unit("antman-coordinator.service")["Service"]
    assert sc["User"] == "root"
    assert "CAP_CHOWN" in sc["CapabilityBoundingSet"]  # per-job socket directories owned by the job's user
    assert sc["RuntimeDirectory"] == "slurm-antman"  # /run/slurm-antman, the default sidecar.socket_dir
    assert co["User"] == "slurm-antman" and co["CapabilityBoundingSet"] == ""
    text = (UNITS / "antman-coordinator.service").read_text()
    assert "sacctmgr" in text and "SlurmUser" in text  # how the user becomes allowed to run scontrol


@pytest.mark.parametrize("name", ["antman-sidecar.service", "antman-coordinator.service"])
def test_systemd_analyze_verify(name, tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd); the key checks above still ran")
    # verify insists that ExecStart exists here; the antman entry point of this checkout stands in.
    exe = shutil.which("antman") or "/bin/true"
    text = (UNITS / name).read_text().replace("/opt/slurm-antman/bin/antman", exe)
    (tmp_path / name).write_text(text)
    r = subprocess.run([tool, "verify", str(tmp_path / name)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Unknown key" not in r.stderr and "Unknown section" not in r.stderr, r.stderr


# --- SIGHUP -------------------------------------------------------------------------------

def _write(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    os.replace(tmp, path)


class LogReader:
    """The daemon's stderr (merged into stdout) read without blocking, line by line."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        os.set_blocking(proc.stdout.fileno(), False)
        self.text = ""

    def wait_for(self, needle: str, timeout: float = 15) -> str:
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            try:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
            except BlockingIOError:
                chunk = b""
            if chunk:
                self.text += chunk.decode(errors="replace")
                continue
            assert self.proc.poll() is None, f"daemon exited ({self.proc.returncode}):\n{self.text}"
            assert time.monotonic() < deadline, f"{needle!r} not logged within {timeout} s:\n{self.text}"
            time.sleep(0.1)
        return self.text


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture
def workdir():
    d = tempfile.mkdtemp(prefix="amh-", dir="/tmp")  # short: Unix socket paths are limited to 107 bytes
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _register_agent(endpoint: str, job_id: str) -> p.Registered:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(endpoint)
        s.send_multipart(p.encode(p.Message(body=p.Register(
            job_id=job_id, pid=os.getpid(), rank=0, local_rank=0, world_size=1, hostname="n1", agent_version="test",
            torch_version="none", device="cuda", job_class="opportunistic"))))
        assert s.poll(5000), "no reply to register"
        msg = p.decode(s.recv_multipart(), p.SIDECAR_TO_AGENT)
        assert msg.type == "registered"
        s.send_multipart(p.encode(p.Message(body=p.Bye(reason="test done"))))
        return msg.body
    finally:
        s.close(0)
        ctx.term()


def test_sidecar_sighup_reloads_and_keeps_jobs(workdir):
    conf = {"nodes": [{"name": "n1", "gpus": 2, "gpu_memory_mb": 8192}],
            "sidecar": {"heartbeat_s": 0.5, "telemetry": "emulated"}}
    path = workdir / "antman.yaml"
    _write(path, conf)
    sock = str(workdir / "s")
    proc = subprocess.Popen([sys.executable, "-m", "slurm_antman.sidecar.cli", "--config", str(path), "--node", "n1",
                             "--socket-dir", sock], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    logs = LogReader(proc)
    try:
        logs.wait_for("serving")
        reg = client.register_job(sock, "501", uid=0, user="root", job_class="opportunistic", gpus=1)
        assert _register_agent(reg.endpoint, "501").heartbeat_s == 0.5

        conf["sidecar"]["heartbeat_s"] = 0.25
        _write(path, conf)
        proc.send_signal(signal.SIGHUP)
        logs.wait_for("configuration reloaded; 1 job(s) kept: 501")
        assert [j.job_id for j in client.node_state(sock).jobs] == ["501"]
        assert _register_agent(reg.endpoint, "501").heartbeat_s == 0.25  # the new value applies

        _write(path, "nodes: [{name: n1, gpus: 2}]\nsidecar: {heartbeat_s: -3}\n")
        proc.send_signal(signal.SIGHUP)
        text = logs.wait_for("reload REJECTED")
        assert "sidecar.heartbeat_s" in text.split("reload REJECTED", 1)[1].splitlines()[0]
        client.ping(sock)
        assert [j.job_id for j in client.node_state(sock).jobs] == ["501"]
        assert _register_agent(reg.endpoint, "501").heartbeat_s == 0.25  # the old one is kept
        assert proc.poll() is None
    finally:
        _stop(proc)


def test_coordinator_sighup_reloads_and_rejects_invalid(workdir):
    conf = {"nodes": [{"name": "n1", "gpus": 2}], "tenants": [{"account": "vision", "guaranteed_gpus": 1}],
            "coordinator": {"audit_log": str(workdir / "audit.jsonl"), "cycle_s": 0.5}}
    path = workdir / "antman.yaml"
    _write(path, conf)
    # No Slurm commands on PATH: every cycle is skipped with a warning, the daemon keeps running.
    env = {"PATH": str(workdir), "PYTHONPATH": str(REPO), "HOME": str(workdir)}
    proc = subprocess.Popen([sys.executable, "-m", "slurm_antman.coordinator.daemon", "--config", str(path)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    logs = LogReader(proc)
    try:
        logs.wait_for("coordinator started")
        conf["tenants"][0]["guaranteed_gpus"] = 3
        _write(path, conf)
        proc.send_signal(signal.SIGHUP)
        logs.wait_for("configuration reloaded")
        _write(path, "nodes: []\n")
        proc.send_signal(signal.SIGHUP)
        text = logs.wait_for("reload REJECTED")
        assert "nodes" in text.split("reload REJECTED", 1)[1].splitlines()[0]
        logs.wait_for("cycle skipped")
        assert proc.poll() is None
    finally:
        _stop(proc)


def test_coordinator_reload_keeps_state_and_applies_new_params(tmp_path):
    path = tmp_path / "antman.yaml"
    base = {"nodes": [{"name": "n1", "gpus": 2}], "grace_time_s": 30,
            "coordinator": {"audit_log": str(tmp_path / "audit.jsonl")}}
    _write(path, base)
    coord = Coordinator(cfgmod.load(path), backend=CliBackend(env={"PATH": str(tmp_path)}, timeout=5))
    coord.config_path = str(path)
    coord.start()
    try:
        state = coord.state
        _write(path, {**base, "grace_time_s": 90})
        assert coord.reload() is True
        assert coord.cfg.grace_time_s == 90 and coord.params.grace_s == 90
        assert coord.executor.cfg.grace_time_s == 90
        assert coord.state is state
        _write(path, {**base, "grace_time_s": "soon"})
        assert coord.reload() is False
        assert coord.cfg.grace_time_s == 90
    finally:
        coord.close()
