"""The agent's protocol client against a sidecar peer over real ZeroMQ IPC, with real training loops.

The peer is ``slurm_antman.lab.bench.control.PeerSidecar``: a ROUTER speaking the sidecar side of
docs/protocol.md (the full sidecar daemon is tested in its own files).
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

import torch_patch
from slurm_antman import protocol as P
from slurm_antman.lab.bench.control import PeerSidecar
from torch_patch.agent import Agent

HB = 0.1  # heartbeat_s the peer hands out: the agent declares it lost after 5 x HB


def _job():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 32), torch.randn(8, 1)

    def iteration() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    return iteration


def _train_until(it, cond, timeout: float = 10.0, what: str = "condition") -> int:
    deadline = time.monotonic() + timeout
    n = 0
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached after {n} iterations")
        it()
        n += 1
    return n


@pytest.fixture
def sock_path(tmp_path):
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be long.
    short = f"/tmp/antman-agent-test-{os.getpid()}-{tmp_path.name[-20:]}"
    os.makedirs(short, exist_ok=True)
    yield os.path.join(short, "jobs", "42", "agent.sock")
    import shutil

    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def peer(sock_path):
    p = PeerSidecar(sock_path, heartbeat_s=HB).start()
    yield p
    p.stop()


@pytest.fixture(autouse=True)
def _no_global_agent():
    torch_patch.uninstall()
    yield


def _agent(endpoint: str, job_class: str = "opportunistic") -> Agent:
    return Agent(job_id="42", job_class=job_class, endpoint=endpoint, use_cuda=False).start()


def test_register_report_and_limit_applied_from_the_next_iteration(peer):
    agent = _agent(peer.endpoint)
    it = _job()
    try:
        assert agent.client.registered.wait(5)
        reg = peer.wait_type("register").msg.body
        assert (reg.job_id, reg.pid, reg.device, reg.job_class) == ("42", os.getpid(), "cpu", "opportunistic")
        _train_until(it, lambda: peer.of_type("report"), what="a report")
        # Send limits in the middle of an iteration and hold that iteration until the agent's thread
        # has them, so the iteration during which they arrived is known exactly.
        it()
        seq, _ = peer.send_limits(3 << 30, 1.0)
        arrived_during = agent.iteration
        deadline = time.monotonic() + 5
        while agent._pending is None:
            assert time.monotonic() < deadline, "limits never reached the agent"
            time.sleep(0.001)
        assert agent.memory.limit_bytes != 3 << 30, "applied before the iteration boundary"
        it()  # ends iteration `arrived_during`
        ack = peer.wait_type("ack", where=lambda b: b.seq == seq).msg.body
        assert ack.applied_iteration == arrived_during + 1
        assert agent.memory.limit_bytes == 3 << 30
        _train_until(it, lambda: any(r.msg.body.limits_seq == seq for r in peer.of_type("report")),
                     what="a report with the new limits_seq")
        rep = [r.msg.body for r in peer.of_type("report")][-1]
        assert rep.iteration >= arrived_during and rep.iterations >= 1 and rep.mem_reserved_bytes > 0
        # Old or repeated seqs are ignored.
        peer.seq = seq - 1
        peer.send_limits(1 << 20, 1.0)
        time.sleep(0.05)
        for _ in range(3):
            it()
        assert agent.memory.limit_bytes == 3 << 30
    finally:
        agent.stop()
    assert peer.wait_type("bye").msg.body.reason == "exit"


@pytest.mark.parametrize("job_class", ["opportunistic", "guaranteed"])
def test_sidecar_restart_fallback_and_reconnect(sock_path, job_class):
    peer = PeerSidecar(sock_path, heartbeat_s=HB, job_class=job_class, mem_limit_bytes=2 << 30, compute_share=0.9,
                       throttle="iteration").start()
    agent = _agent(peer.endpoint, job_class)
    it = _job()
    try:
        assert agent.client.registered.wait(5)
        _train_until(it, lambda: agent.throttle.share == 0.9, what="registered limits applied")
        assert agent.memory.limit_bytes == 2 << 30
        peer.stop()  # gone without a bye, as after a crash
        _train_until(it, lambda: not agent.client.connected, what="sidecar loss detected")
        it()
        if job_class == "opportunistic":
            assert agent.throttle.share == 0.25 and agent.memory.limit_bytes == 2 << 30
        else:
            assert agent.throttle.share == 1.0 and agent.memory.limit_bytes is None
        # A new sidecar on the same endpoint, which starts its seqs afresh.
        peer = PeerSidecar(sock_path, heartbeat_s=HB, job_class=job_class, mem_limit_bytes=1 << 30,
                           compute_share=0.8, throttle="iteration").start()
        _train_until(it, lambda: agent.throttle.share == 0.8, what="re-registration")
        assert agent.memory.limit_bytes == 1 << 30 and agent.applied_seq == 0
        seq, _ = peer.send_limits(1 << 29, 1.0)
        _train_until(it, lambda: agent.applied_seq == seq, what="limits from the new sidecar")
        assert agent.client.registrations >= 2
    finally:
        agent.stop()
        peer.stop()


def _env(mtype: str, body: dict, v: int = 1) -> list[bytes]:
    return [P.MARKER, json.dumps({"v": v, "type": mtype, "id": "x1", "ts": 1.0, "ref": None, "body": body}).encode()]


def test_malformed_messages_are_logged_and_ignored(peer):
    agent = _agent(peer.endpoint)
    it = _job()
    try:
        assert agent.client.registered.wait(5)
        bad = [
            [b"just one frame"],
            [b"NOTANTMAN", b"{}"],
            [P.MARKER, b"{not json"],
            [P.MARKER, b"\xff\xfe"],
            [P.MARKER, b"[1, 2]"],
            _env("reboot", {}),
            _env("limits", {"seq": 5, "mem_limit_bytes": None, "compute_share": 7.0}),
            _env("limits", {"seq": 5, "mem_limit_bytes": None, "compute_share": 0.5, "extra": 1}),
            _env("limits", {"seq": "5", "mem_limit_bytes": None, "compute_share": 0.5}),
            _env("report", {}),  # wrong direction
            [P.MARKER, b"x" * (P.MAX_MESSAGE_BYTES + 10)],  # over the size limit: dropped by zmq
        ]
        for frames in bad:
            peer.send_raw(frames)
        start = agent.iteration
        _train_until(it, lambda: agent.client.malformed_received >= len(bad) - 1, what="all malformed received")
        for _ in range(5):
            it()
        assert agent.iteration >= start + 5 and agent.client.is_alive()
        assert agent.throttle.share == 1.0 and agent.applied_seq == 0
        want = {"bad_frames", "bad_json", "bad_envelope", "unknown_type", "bad_value", "extra_field",
                "bad_type", "wrong_direction"}
        # The agent counts a message when it handles it; its error reply is still on the way to us.
        deadline = time.monotonic() + 10
        while not want <= {r.msg.body.code for r in peer.of_type("error")} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert want <= {r.msg.body.code for r in peer.of_type("error")}
        # Still managed: a valid limits after all that is applied.
        seq, _ = peer.send_limits(None, 0.9)
        _train_until(it, lambda: agent.applied_seq == seq, what="valid limits after garbage")
    finally:
        agent.stop()


def test_version_mismatch_leaves_the_job_unmanaged_and_training(peer):
    agent = _agent(peer.endpoint)
    it = _job()
    try:
        assert agent.client.registered.wait(5)
        seq, _ = peer.send_limits(1 << 30, 0.9)
        _train_until(it, lambda: agent.applied_seq == seq, what="limits")
        peer.send_raw(_env("limits", {"seq": 9, "mem_limit_bytes": 1, "compute_share": 0.1}, v=2))
        _train_until(it, lambda: agent.client.unmanaged, what="unmanaged")
        it()
        assert agent.throttle.share == 1.0 and agent.memory.limit_bytes is None
        err = peer.wait_type("error", where=lambda b: b.code == "version_mismatch").msg.body
        assert "v2" in err.message and "v1" in err.message
    finally:
        agent.stop()


def test_preempt_calls_the_checkpoint_hook_in_the_training_thread(peer):
    agent = _agent(peer.endpoint)
    it = _job()
    calls = []
    agent.on_preempt(lambda n: calls.append((n.reason, threading.current_thread() is threading.main_thread())))
    try:
        assert agent.client.registered.wait(5)
        peer.send_body(P.Preempt(deadline_unix=time.time() + 30, grace_s=30, reason="guaranteed job needs GPU 0"))
        _train_until(it, lambda: calls, what="preempt hook")
        for _ in range(3):
            it()
        assert calls == [("guaranteed job needs GPU 0", True)]
    finally:
        agent.stop()


def test_preempt_hook_runs_from_the_agent_thread_if_no_boundary_comes(peer):
    agent = _agent(peer.endpoint)
    called = threading.Event()
    agent.on_preempt(lambda n: called.set())
    try:
        assert agent.client.registered.wait(5)
        peer.send_body(P.Preempt(deadline_unix=time.time() + 0.4, grace_s=0.4, reason="r"))
        assert called.wait(3), "hook not called before the deadline without iterations"
    finally:
        agent.stop()



def test_a_busy_loop_takes_limits_and_acks_on_its_own_thread(peer):
    """While boundaries keep coming, limits are received and acknowledged by the training thread at
    its boundary: no hand-over to the protocol thread, which would wait for the GIL each way."""
    agent = _agent(peer.endpoint)
    received_on, sent_on = [], []
    arrived, send = agent._limits_arrived, agent.client._send

    def on_limits(upd):
        received_on.append(threading.current_thread().name)
        arrived(upd)

    def spy_send(sock, body, ref=None):
        if isinstance(body, P.Ack):
            sent_on.append(threading.current_thread().name)
        return send(sock, body, ref)

    agent.client._on_limits, agent.client._send = on_limits, spy_send
    x = torch.randn(16, 16)

    def iteration():
        torch.mm(x, x)
        agent.step()

    try:
        assert agent.client.registered.wait(5)
        received_on.clear()
        for i in range(20):
            seq, _ = peer.send_limits((1 + i % 2) << 30, 1.0)
            _train_until(iteration, lambda: any(r.msg.body.seq == seq for r in peer.of_type("ack")),
                         what=f"ack of seq {seq}")
        main = threading.current_thread().name
        # A stall of the machine longer than the protocol thread's patience may hand one over.
        assert received_on.count(main) >= 17, received_on
        assert sent_on.count(main) >= 17, sent_on
        assert [a[2] - a[1] for a in agent.acks if a[1] is not None] and \
            max(a[2] - a[1] for a in agent.acks if a[1] is not None) <= 1
    finally:
        agent.stop()

def test_a_raised_share_ends_the_idle_owed_at_the_old_one(peer):
    """Held at 0.01 (a guaranteed neighbour's baseline probe), an iteration of 40 ms owes about 4 s of
    idle. The raise that ends the probe must not wait for it: the idle still owed is eased to the new
    share at the next hook, and from the boundary on the job idles as the new share says."""
    agent = _agent(peer.endpoint)

    class Step(torch.nn.Module):
        def forward(self, x):
            time.sleep(0.02)  # device time, as the throttle's hooks see it
            return x * 2

    model, x = torch.nn.Sequential(Step(), Step()), torch.randn(4, 4)

    def iteration():
        model(x)
        agent.step()

    try:
        assert agent.client.registered.wait(5)
        for _ in range(6):
            iteration()  # the unthrottled reference, ~40 ms
        seq, _ = peer.send_limits(None, 0.01)
        _train_until(iteration, lambda: any(r.msg.body.seq == seq for r in peer.of_type("ack")),
                     what="the hold applied", timeout=20)
        assert agent.throttle.share == 0.01
        raise_at = threading.Timer(0.3, lambda: peer.send_limits(None, 0.5))
        raise_at.start()
        t0 = time.perf_counter()
        iteration()
        held = time.perf_counter() - t0
        raise_at.join()
        _train_until(iteration, lambda: agent.throttle.share == 0.5, what="the raise applied")
        assert held < 2.0, f"the iteration kept the old share's idle: {held:.2f} s (about 4 s owed)"
        idle0 = agent.throttle.idle_s
        for _ in range(3):
            iteration()
        # ~40 ms owed per iteration at 0.5: a hurry left set would skip it all.
        assert agent.throttle.idle_s - idle0 > 0.03
    finally:
        agent.stop()


def test_bad_endpoint_and_class_are_rejected_clearly():
    from torch_patch.agent import AgentConfigError
    from torch_patch.client import EndpointError

    with pytest.raises(EndpointError, match="ANTMAN_SIDECAR_ENDPOINT.*node-local"):
        Agent(job_id="42", endpoint="tcp://10.0.0.1:5555", use_cuda=False)
    with pytest.raises(AgentConfigError, match="ANTMAN_CLASS='best'.*allowed"):
        Agent(job_id="42", job_class="best", use_cuda=False)
    with pytest.raises(AgentConfigError, match="ANTMAN_JOB_ID"):
        Agent(job_id="../1", use_cuda=False)


# Slow (25 s: the gap must stretch and come back over many reports), and timing-bound under load:
# make test is at its 15-minute limit.
@pytest.mark.slow
def test_dear_reports_are_spread_out_to_keep_their_cost_within_budget(peer):
    """A report that takes 2 ms (on a GPU, reading the allocator costs that much) would take 4 % of a
    job reporting every 50 ms: the agent stretches the gap until reports cost REPORT_BUDGET, at most
    REPORT_MAX_GAP_S apart, and goes back to the base interval when they are cheap again."""
    from torch_patch.agent import REPORT_BUDGET, REPORT_MAX_GAP_S

    agent = _agent(peer.endpoint)
    it = _job()
    real_stats = agent.memory.stats
    slow = [True]

    def stats():
        if slow[0]:
            time.sleep(0.002)
        return real_stats()

    agent.memory.stats = stats
    try:
        assert agent.client.registered.wait(5)
        _train_until(it, lambda: len(peer.of_type("report")) >= 6, what="six reports")
        assert 0.002 / REPORT_BUDGET * 0.5 <= agent._report_gap <= REPORT_MAX_GAP_S
        dear_gap = agent._report_gap
        slow[0] = False
        # Cheap again, the gap comes down from where the dear reports put it. Not all the way to the
        # base interval on this CPU: a report here costs 0.3 ms by itself (0.15 s at the budget), and
        # more on a loaded machine, so the bound is what a report under 0.8 ms gives.
        _train_until(it, lambda: agent._report_gap < 0.8 * dear_gap, timeout=30,
                     what=f"the gap coming back down from {dear_gap} s (report cost {agent._report_cost} s)")
    finally:
        agent.stop()


def test_root_modules_are_the_models_not_their_layers():
    """GpuBusy hooks the roots only: one pre-hook call per iteration, not one per layer."""
    from torch_patch.busy import root_modules

    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    model = torch.nn.Sequential(inner, torch.nn.Linear(4, 1))
    other = torch.nn.Linear(3, 3)
    no_params = torch.nn.ReLU()
    roots = root_modules(torch, torch.device("cpu"))
    ids = {id(m) for m in roots}
    assert id(model) in ids and id(other) in ids
    assert id(inner) not in ids and id(no_params) not in ids
    assert not any(id(m) == id(inner[0]) for m in roots)
