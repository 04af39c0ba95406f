"""Elastic width, the agent's side (docs/elastic.md), against a sidecar peer over real ZeroMQ IPC with a
real training loop on CPU; the launcher is a Unix datagram socket the test binds. The launcher itself
and a whole job through a shrink and a grow are tests/test_elastic_launch.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time

import pytest
import torch

import torch_patch
from slurm_antman import protocol as P
from slurm_antman.lab.bench.control import PeerSidecar
from torch_patch.agent import Agent

HB = 0.1


def _job():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 16), torch.randn(32, 1)

    def iteration() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    return iteration


@pytest.fixture
def short_dir(tmp_path):
    short = f"/tmp/antman-width-{os.getpid()}-{tmp_path.name[-12:]}"
    os.makedirs(short, exist_ok=True)
    yield short
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def peer(short_dir):
    p = PeerSidecar(os.path.join(short_dir, "jobs", "42", "agent.sock"), heartbeat_s=HB).start()
    yield p
    p.stop()


@pytest.fixture
def launcher(short_dir):
    """The launcher's end of ANTMAN_LAUNCHER_SOCKET: a bound datagram socket."""
    path = os.path.join(short_dir, "launcher.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(10)
    yield path, s
    s.close()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    torch_patch.uninstall()
    for name in (P.ENV_LAUNCHER_SOCKET, "LOCAL_RANK", "SLURM_LOCALID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield


def _register(peer):
    return peer.wait_type("register").msg.body


def test_only_local_rank_0_under_the_launcher_names_the_width_feature(peer, launcher, monkeypatch):
    # No launcher socket in the environment: no feature.
    agent = Agent(job_id="42", job_class="opportunistic", endpoint=peer.endpoint, use_cuda=False).start()
    try:
        reg = _register(peer)
        assert P.FEATURE_WIDTH not in reg.features and P.FEATURE_PAUSE in reg.features
        assert agent.launcher_socket is None
    finally:
        agent.stop()
    # The launcher's socket, local rank 1: still none (one agent speaks for the node's workers).
    monkeypatch.setenv(P.ENV_LAUNCHER_SOCKET, launcher[0])
    monkeypatch.setenv("LOCAL_RANK", "1")
    peer.received.clear()
    agent = Agent(job_id="42", job_class="opportunistic", endpoint=peer.endpoint, use_cuda=False).start()
    try:
        reg = _register(peer)
        assert reg.local_rank == 1 and P.FEATURE_WIDTH not in reg.features
    finally:
        agent.stop()
    # Local rank 0 under the launcher: it does.
    monkeypatch.setenv("LOCAL_RANK", "0")
    peer.received.clear()
    agent = Agent(job_id="42", job_class="opportunistic", endpoint=peer.endpoint, use_cuda=False).start()
    try:
        reg = _register(peer)
        assert reg.local_rank == 0 and P.FEATURE_WIDTH in reg.features and P.FEATURE_PAUSE in reg.features
        assert agent.launcher_socket == launcher[0]
    finally:
        agent.stop()


def test_an_agent_without_the_feature_answers_width_with_unknown_type(peer):
    agent = Agent(job_id="42", job_class="opportunistic", endpoint=peer.endpoint, use_cuda=False).start()
    try:
        _register(peer)
        mid = peer.send_body(P.Width(seq=1, gpus=[0], reason="test"))
        err = peer.wait_type("error").msg
        assert err.ref == mid and err.body.code == P.ErrorCode.unknown_type.value and "width" in err.body.message
        assert not peer.of_type("width_done")
    finally:
        agent.stop()


def test_width_checkpoints_at_a_boundary_answers_and_hands_the_list_to_the_launcher(peer, launcher):
    path, lsock = launcher
    agent = Agent(job_id="42", job_class="opportunistic", endpoint=peer.endpoint, use_cuda=False,
                  launcher_socket=path, width_wait_s=0.3).start()
    notices: list = []
    order: list = []

    def hook(notice) -> None:
        order.append(("hook", threading.current_thread() is trainer, time.perf_counter()))
        notices.append(notice)

    agent.on_preempt(hook)
    it = _job()
    stop = threading.Event()
    trainer = threading.Thread(target=lambda: [it() for _ in iter(stop.is_set, True)], daemon=True)
    try:
        _register(peer)
        trainer.start()
        peer.wait_type("report")
        mid = peer.send_body(P.Width(seq=2, gpus=[3, 1], reason="guaranteed job 7 claims GPU 0"))
        done = peer.wait_type("width_done").msg
        assert done.ref == mid and done.body.seq == 2 and done.body.checkpoint_ms >= 0.0
        got = json.loads(lsock.recv(4096))
        assert got == {"seq": 2, "gpus": [3, 1]}
        assert len(notices) == 1 and notices[0].width == (3, 1) and notices[0].grace_s == 0.0
        assert notices[0].reason == "width change: guaranteed job 7 claims GPU 0"
        assert order[0][1], "the hook must run in the training thread"
        assert order[0][2] <= peer.wait_type("width_done").t
        deadline = time.monotonic() + 5
        while not agent.widths and time.monotonic() < deadline:
            time.sleep(0.01)  # recorded just after the datagram went
        assert agent.widths == [(2, (3, 1), done.body.checkpoint_ms)]
        # Nobody stopped the job (no launcher acting here): after width_wait_s it trains on.
        n = agent.iteration
        deadline = time.monotonic() + 5
        while agent.iteration < n + 10 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert agent.iteration >= n + 10
        # A stale seq is ignored: no hook, no answer, no datagram; a newer one is carried out.
        peer.send_body(P.Width(seq=2, gpus=[0], reason="again"))
        peer.send_body(P.Width(seq=1, gpus=[0], reason="older"))
        time.sleep(0.3)
        assert len(notices) == 1 and len(peer.of_type("width_done")) == 1
        peer.send_body(P.Width(seq=3, gpus=[0], reason="grow back"))
        peer.wait_type("width_done", where=lambda b: b.seq == 3)
        assert json.loads(lsock.recv(4096)) == {"seq": 3, "gpus": [0]}
        assert [n.width for n in notices] == [(3, 1), (0,)]
        assert not [r for r in peer.received if r.error is not None]
    finally:
        stop.set()
        trainer.join(5)
        agent.stop()


def test_width_with_no_launcher_listening_answers_an_error_and_training_goes_on(peer, short_dir):
    gone = os.path.join(short_dir, "no-launcher.sock")
    agent = Agent(job_id="42", job_class="opportunistic", endpoint=peer.endpoint, use_cuda=False,
                  launcher_socket=gone, width_wait_s=30.0).start()
    it = _job()
    stop = threading.Event()
    trainer = threading.Thread(target=lambda: [it() for _ in iter(stop.is_set, True)], daemon=True)
    try:
        assert P.FEATURE_WIDTH in _register(peer).features
        trainer.start()
        mid = peer.send_body(P.Width(seq=1, gpus=[0], reason="test"))
        err = peer.wait_type("error").msg
        assert err.ref == mid and err.body.code == P.ErrorCode.internal.value and gone in err.body.message
        assert not peer.of_type("width_done") and agent.widths == []
        n = agent.iteration
        deadline = time.monotonic() + 5
        while agent.iteration < n + 10 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert agent.iteration >= n + 10  # it did not wait to be stopped
    finally:
        stop.set()
        trainer.join(5)
        agent.stop()


def test_torchruns_own_process_gets_no_agent_its_workers_do(tmp_path):
    """torchrun (the console script, or ``python -m torch.distributed.run``) imports torch but is no
    rank: an agent there would never reach a boundary, so never acknowledge limits."""
    import subprocess
    import sys

    from torch_patch.activation import is_torchrun

    assert is_torchrun("/opt/venv/bin/torchrun") and is_torchrun("/x/site-packages/torch/distributed/run.py")
    assert is_torchrun("/x/torch/distributed/launch.py")
    assert not is_torchrun("train.py") and not is_torchrun("/home/u/torchrun.py") and not is_torchrun("")
    probe = "import sys, torch, torch_patch; print('patched' if torch_patch.current() else 'plain')\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTMAN_", "SLURM_"))}
    env[P.ENV_CLASS] = "opportunistic"  # activates the hook; no endpoint: an agent that talks to nobody
    got = {}
    for name in ("torchrun", "train.py"):
        (tmp_path / name).write_text(probe)
        r = subprocess.run([sys.executable, str(tmp_path / name)], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        got[name] = r.stdout.strip()
    assert got == {"torchrun": "plain", "train.py": "patched"}
