"""`antman squeue` / `antman nodes` on a real local Slurm cluster, with a real node sidecar, and the
SQUEUE_FORMAT2 line of docs/user.md with plain squeue."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest



REPO = Path(__file__).resolve().parent.parent
# Keep in step with docs/user.md, section "Show the class in plain squeue".
SQUEUE_FORMAT2 = "JobID:10,UserName:10,Partition:14,admin_comment:60,StateCompact:4,ReasonList:20"

pytestmark = pytest.mark.cluster


@pytest.fixture
def sidecar_node1(plain_cluster):
    """A real sidecar for node1 at SOCKET_DIR/node1 (the devcluster layout), emulated telemetry."""
    from slurm_antman.clients import sidecar_control as client
    from slurm_antman import config

    cfg = config.load(plain_cluster.config_path)
    sock = Path(cfg.sidecar.socket_dir) / "node1"
    sock.mkdir(parents=True, exist_ok=True)
    env = dict(plain_cluster.env, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "slurm_antman.cli", "sidecar", "--config",
                             str(plain_cluster.config_path), "--node", "node1", "--socket-dir", str(sock),
                             "--telemetry", "emulated", "--log-level", "WARNING"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(100):
            try:
                client.ping(str(sock), timeout_s=0.5)
                break
            except client.SidecarUnreachable:
                if proc.poll() is not None:
                    pytest.fail(f"sidecar exited: {proc.stderr.read().decode()[-2000:]}")
                time.sleep(0.1)
        yield str(sock)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _antman(cluster, *args: str) -> subprocess.CompletedProcess:
    env = dict(cluster.env, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "slurm_antman.cli", *args], env=env, capture_output=True,
                          text=True, timeout=60, cwd=REPO)


def test_squeue_json_shows_gpus_of_running_job_and_nulls_without_sidecar(backend, plain_cluster):
    jid = backend.submit(wrap="sleep 30", options=["--gres=gpu:2", "-J", "gpujob"])
    held = backend.submit(wrap="sleep 30", options={"hold": True})
    running = backend.wait_for(jid, ["RUNNING"], timeout=30)
    r = _antman(plain_cluster, "squeue", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["job_id"]: row for row in json.loads(r.stdout)}
    row = rows[jid]
    assert (row["class"], row["state"], row["name"], row["user"], row["partition"], row["restarts"]) == (
        "none", "RUNNING", "gpujob", "root", "gpu", 0)
    assert row["gpus"] == running.gpus and len(row["gpus"]) == 2
    assert row["gpus_by_node"] == running.gpus_by_node
    node = running.nodes[0]
    if node != "node1":  # no sidecar for node2 in this test: live fields are null, not an error
        assert row["mem_used_bytes"] is None and row["compute_share"] is None
    assert rows[held]["gpus"] is None and rows[held]["state"] == "PENDING"
    table = _antman(plain_cluster, "squeue")
    assert table.returncode == 0 and "gpujob" in table.stdout and "\x1b[" not in table.stdout


def test_squeue_and_nodes_read_live_numbers_from_the_sidecar(backend, plain_cluster, sidecar_node1):
    from slurm_antman.clients import sidecar_control as client

    jid = backend.submit(wrap="sleep 30", options=["--gres=gpu:1", "-w", "node1"])
    job = backend.wait_for(jid, ["RUNNING"], timeout=30)
    client.register_job(sidecar_node1, str(jid), uid=0, user="root", job_class="guaranteed", gpus=1,
                        physical_gpus=job.gpus)
    r = _antman(plain_cluster, "squeue", "--json")
    assert r.returncode == 0, r.stderr
    row = {x["job_id"]: x for x in json.loads(r.stdout)}[jid]
    assert row["compute_share"] is not None and 0 < row["compute_share"] <= 1
    assert isinstance(row["mem_used_bytes"], int)
    n = _antman(plain_cluster, "nodes", "--json") if _has_nodes_cmd() else None
    data = json.loads(n.stdout) if n is not None else _nodes_in_process(plain_cluster)
    nodes = {x["name"]: x for x in data}
    assert nodes["node1"]["sidecar"] is True and nodes["node1"]["telemetry"] == "emulated"
    gpu = nodes["node1"]["gpus"][job.gpus[0]]
    assert gpu["index"] == job.gpus[0] and gpu["memory_total_bytes"] == 16384 * 2**20
    # Each GPU's jobs carry more (their numbers, for their owners); id and class as ever.
    on_gpu = next(j for j in gpu["jobs"] if j["job_id"] == jid)
    assert (on_gpu["job_id"], on_gpu["class"]) == (jid, "guaranteed")
    assert nodes["node2"]["sidecar"] is False and nodes["node2"]["gpus"] is None
    assert nodes["node1"]["gres"]["gpu"] == 4
    client.retire_job(sidecar_node1, str(jid))


def _has_nodes_cmd() -> bool:
    from slurm_antman import cli

    return "nodes" in cli.build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001


def _nodes_in_process(cluster) -> list:
    """Until `antman nodes` is wired into cli.py, run the view's main() in a child Python."""
    code = ("import argparse, sys; from slurm_antman.views import nodes as nodes_view; "
            "sys.exit(nodes_view.main(argparse.Namespace(json=True)))")
    r = subprocess.run([sys.executable, "-c", code], env=dict(cluster.env, PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_plain_squeue_shows_the_class_with_squeue_format2(backend, plain_cluster):
    jid = backend.submit(wrap="sleep 30", options={"hold": True})
    backend.update(jid, AdminComment="antman:class=opportunistic")
    r = subprocess.run(["squeue"], env=dict(plain_cluster.env, SQUEUE_FORMAT2=SQUEUE_FORMAT2),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.split()[:1] == [str(jid)])
    assert "antman:class=opportunistic" in line and "ADMIN_COMMENT" in r.stdout.splitlines()[0]


def test_docs_carry_the_tested_format():
    text = (REPO / "docs" / "user.md").read_text()
    assert f"SQUEUE_FORMAT2='{SQUEUE_FORMAT2}'" in text


def test_bad_config_is_a_clear_error(plain_cluster, tmp_path):
    bad = tmp_path / "antman.yaml"
    bad.write_text("nodes: []\n")
    r = subprocess.run([sys.executable, "-m", "slurm_antman.cli", "squeue", "--json"],
                       env=dict(plain_cluster.env, ANTMAN_CONFIG=str(bad), PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode != 0 and "nodes" in r.stderr and "Traceback" not in r.stderr


def test_a_job_its_sidecar_paused_in_place_shows_paused():
    """Paused in place: Slurm says RUNNING; the sidecar has moved its GPU state to the host: PAUSED."""
    from slurm_antman import protocol as p
    from slurm_antman.slurm.models import Job
    from slurm_antman.views.squeue import rows

    job = Job(7, "train", "alice", "research", "opportunistic", "RUNNING", "None", "node1", ["node1"], 0,
              "antman:class=opportunistic", "", "opportunistic", {"node1": [0]}, "", None, None)

    def state(paused: bool) -> p.NodeStateReply:
        return p.NodeStateReply(node="node1", telemetry="emulated", sidecar_version="t", gpus=[], preemptions=[],
                                jobs=[p.JobState(job_id="7", job_class="opportunistic", uid=1000, gpus=[0],
                                                 mem_limit_bytes=1 << 30, mem_used_bytes=0, compute_share=0.05,
                                                 iteration_ms=None, baseline_ms=None, last_report_unix=None,
                                                 agents=1, limits_seq=2, acked_seq=1, paused=paused)])

    assert rows([job], {"node1": state(True)})[0]["state"] == "PAUSED"
    assert rows([job], {"node1": state(False)})[0]["state"] == "RUNNING"
    assert rows([job], {})[0]["state"] == "RUNNING"  # no sidecar answering: Slurm's word
