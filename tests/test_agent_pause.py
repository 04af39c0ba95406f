"""Pause in place (issue 16), the agent's side, against a sidecar peer over real ZeroMQ IPC with a real
training loop on CPU. GPU memory is emulated here (the agent's trace-replay emulation): what a pause
frees and restores is the emulated footprint; the CUDA move itself is the gpu test below."""

from __future__ import annotations

import os
import shutil
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
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(64, 32), torch.randn(64, 1)

    def iteration() -> float:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return iteration


@pytest.fixture
def peer(tmp_path):
    short = f"/tmp/antman-pause-{os.getpid()}-{tmp_path.name[-12:]}"
    os.makedirs(short, exist_ok=True)
    p = PeerSidecar(os.path.join(short, "jobs", "42", "agent.sock"), heartbeat_s=HB).start()
    yield p
    p.stop()
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_global_agent():
    torch_patch.uninstall()
    yield


def test_an_agent_says_it_can_pause_and_an_old_one_is_never_asked(peer):
    agent = Agent(job_id="42", job_class="opportunistic", endpoint=peer.endpoint, use_cuda=False).start()
    try:
        reg = peer.wait_for(lambda r: r.msg is not None and r.msg.type == "register").msg.body
        assert P.FEATURE_PAUSE in reg.features
    finally:
        agent.stop()
    # A register without the field (an older agent) decodes with no features.
    old = P.message(P.Register(job_id="1", pid=1, rank=0, local_rank=0, world_size=1, hostname="h",
                               agent_version="0.0.9", torch_version="2.0", device="cpu", job_class="none"))
    frames = P.encode(old)
    frames[-1] = frames[-1].replace(b',"features":[]', b"")
    assert b"features" not in frames[-1] and P.decode(frames).body.features == ()


def test_pause_frees_the_footprint_blocks_training_and_resume_continues_where_it_was(peer):
    agent = Agent(job_id="42", job_class="opportunistic", endpoint=peer.endpoint, use_cuda=False).start()
    agent.emulate_device(3 << 30, 0.9)
    it = _job()
    losses: list[float] = []
    stop = threading.Event()

    def train() -> None:
        while not stop.is_set() and len(losses) < 100_000:
            losses.append(it())

    t = threading.Thread(target=train, daemon=True)
    try:
        peer.wait_for(lambda r: r.msg is not None and r.msg.type == "register")
        t.start()
        peer.wait_for(lambda r: r.msg is not None and r.msg.type == "report" and r.msg.body.mem_reserved_bytes == 3 << 30)
        sent = time.perf_counter()
        peer.send_body(P.Pause(seq=1, reason="guaranteed job 7 needs GPU 0's memory"))
        paused = peer.wait_for(lambda r: r.msg is not None and r.msg.type == "paused").msg.body
        acked_ms = (time.perf_counter() - sent) * 1000.0
        assert paused.seq == 1 and paused.bytes_freed == 3 << 30 and paused.bytes_moved == 3 << 30
        assert 0.0 <= paused.pause_ms <= acked_ms
        n = len(losses)
        time.sleep(0.5)
        assert len(losses) == n  # blocked at the boundary
        assert agent.memory.stats().reserved_bytes == 0
        # Heartbeats go on while paused: the peer keeps hearing from the agent.
        heard = len(peer.received)
        time.sleep(3 * HB)
        assert len(peer.received) > heard
        peer.send_body(P.Resume(seq=1))
        resumed = peer.wait_for(lambda r: r.msg is not None and r.msg.type == "resumed").msg.body
        assert resumed.seq == 1 and resumed.resume_ms >= 0.0
        deadline = time.monotonic() + 5
        while len(losses) < n + 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(losses) >= n + 20 and losses[-1] < losses[n - 1]  # training went on, and on improving
        peer.wait_for(lambda r: r.msg is not None and r.msg.type == "report" and r.msg.body.mem_reserved_bytes == 3 << 30)
        assert [p[0] for p in agent.pauses] == [1]
    finally:
        stop.set()
        agent._resume_evt.set()
        t.join(5)
        agent.stop()


def test_a_paused_job_whose_sidecar_goes_away_resumes_by_itself(peer):
    agent = Agent(job_id="42", job_class="opportunistic", endpoint=peer.endpoint, use_cuda=False,
                  missed_heartbeats=3).start()
    agent.emulate_device(1 << 30, 0.5)
    it = _job()
    stop = threading.Event()
    count = [0]

    def train() -> None:
        while not stop.is_set():
            it()
            count[0] += 1

    t = threading.Thread(target=train, daemon=True)
    try:
        peer.wait_for(lambda r: r.msg is not None and r.msg.type == "register")
        t.start()
        peer.send_body(P.Pause(seq=5, reason="test"))
        peer.wait_for(lambda r: r.msg is not None and r.msg.type == "paused")
        n = count[0]
        peer.stop()  # no resume will ever come
        deadline = time.monotonic() + 5
        while count[0] <= n + 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert count[0] > n + 5 and agent.paused_seq is None
    finally:
        stop.set()
        t.join(5)
        agent.stop()


@pytest.mark.gpu
def test_pause_moves_parameters_grads_buffers_and_optimizer_state_to_the_host_and_back():
    """On a GPU: the device memory a model, its gradients, a BatchNorm's buffers and Adam's state
    hold is freed by a pause, and training resumes with identical numbers to an unpaused twin."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from torch_patch.memory import MemoryController
    from torch_patch.pause import Pauser

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.BatchNorm1d(4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 1024)).cuda()
        return m, torch.optim.Adam(m.parameters(), lr=1e-3)

    x = torch.randn(256, 1024, device="cuda")

    def step(m, o):
        o.zero_grad(set_to_none=False)
        loss = m(x).square().mean()
        loss.backward()
        o.step()
        return loss.item()

    m1, o1 = build()
    m2, o2 = build()
    for _ in range(3):
        step(m1, o1), step(m2, o2)
    pauser = Pauser(torch, MemoryController(use_cuda=True))
    pauser.saw_optimizer(o1)
    before = torch.cuda.memory_allocated()
    freed, moved = pauser.pause()
    assert moved > 0 and torch.cuda.memory_allocated() < before
    assert all(p.device.type == "cpu" for p in m1.parameters())
    pauser.resume()
    first = step(m1, o1)
    pauser.after_boundary()
    assert [first] + [step(m1, o1) for _ in range(2)] == [step(m2, o2) for _ in range(3)]


def test_bench_pause_runs_a_real_sidecar_and_training_process_through_every_round():
    """`antman bench pause --no-requeue`: each round a burst pauses the job and its end resumes it,
    acked by the job's real agent (the numbers themselves go to docs/benchmarks.md, not here)."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "slurm_antman.cli", "bench", "pause", "--no-requeue", "--rounds", "2",
                        "--footprint-gib", "2", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)["pause"]
    assert doc["rounds"] == 2 and len(doc["pause_ack_ms"]) == len(doc["resume_ms"]) == 2
    assert all(v >= 0 for v in doc["pause_ack_ms"] + doc["resume_ms"])
    bad = subprocess.run([sys.executable, "-m", "slurm_antman.cli", "bench", "pause", "--footprint-gib", "20"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--footprint-gib must be in (0, 14]" in bad.stderr
