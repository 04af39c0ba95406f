"""The sidecar daemon over real ZeroMQ IPC sockets: control requests, agents (a plain DEALER speaking
the protocol), limits and preemption, malformed and fuzzed input, permissions, restart."""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import subprocess
import tempfile
import threading
import time

import pytest
import zmq

from slurm_antman import config as cfgmod
from slurm_antman import protocol as p
from slurm_antman.clients import sidecar_control as client
from slurm_antman.sidecar.cli import build
from slurm_antman.policy.node.core import GiB, MiB

NOBODY = 65534
GPU_MB = 16384


def make_config(gpus: int = 2, window_s: float = 10.0, **sidecar):
    return cfgmod.parse({
        "nodes": [{"name": "n1", "gpus": gpus, "gpu_memory_mb": GPU_MB}],
        "sidecar": {"heartbeat_s": 0.2, "telemetry": "emulated", **sidecar},
        # Two slots: the placement tests fill a GPU's slots with two jobs.
        "opportunistic": {"utilization_window_s": window_s, "slots_per_gpu": 2},
        "grace_time_s": 30,
    })


def wait_measured(sockdir: str, gpu: int) -> None:
    """Until the sidecar's utilisation window shows the guaranteed job on ``gpu`` (slurm_antman.policy.node.placement)."""
    wait_for(lambda: client.node_state(sockdir).gpus[gpu].util_measured, what=f"GPU {gpu} measured")


class Running:
    """A real sidecar serving in a thread; ``stop()`` joins it."""

    def __init__(self, socket_dir: str, conf=None):
        self.sidecar = build(conf or make_config(), "n1", socket_dir, tick_s=0.1)
        self.sidecar.start()
        self.thread = threading.Thread(target=self.sidecar.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.sidecar.stop()
        self.thread.join(5)
        assert not self.thread.is_alive()


@pytest.fixture
def sockdir():
    # Short path: Unix socket paths are limited to 107 bytes, pytest's tmp_path can be longer.
    d = tempfile.mkdtemp(prefix="am-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sidecar(sockdir):
    r = Running(sockdir)
    yield r
    r.stop()


class SimAgent:
    """An agent simulator: a DEALER that speaks the protocol."""

    def __init__(self, endpoint: str, job_id: str, job_class: str = "opportunistic", pid: int | None = None,
                 rank: int = 0, features: tuple[str, ...] = ()):
        self.features = list(features)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        # The sidecar checks register.pid against the connecting process (SO_PEERCRED): this one.
        self.job_id, self.job_class, self.pid, self.rank = job_id, job_class, pid or os.getpid(), rank
        self.iteration = 0

    def send(self, body, ref=None) -> p.Message:
        msg = p.Message(body=body, ref=ref)
        self.sock.send_multipart(p.encode(msg))
        return msg

    def send_raw(self, frames):
        self.sock.send_multipart(frames)

    def recv(self, want: str, timeout_s: float = 5.0) -> p.Message:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no {want!r} within {timeout_s} s"
            if self.sock.poll(int(left * 1000)):
                msg = p.decode(self.sock.recv_multipart(), p.SIDECAR_TO_AGENT)
                if msg.type == want:
                    return msg

    def register(self) -> p.Message:
        req = self.send(p.Register(job_id=self.job_id, pid=self.pid, rank=self.rank, local_rank=self.rank,
                                   world_size=1, hostname="n1", agent_version="sim", torch_version="none",
                                   device="cuda", job_class=self.job_class, features=self.features))
        reply = self.recv("registered")
        assert reply.ref == req.id
        return reply

    def report(self, ms: float, reserved: int, busy_ms: float | None = None, seq: int = 0) -> None:
        self.iteration += 1
        self.send(p.Report(iteration=self.iteration, iterations=1, iteration_ms=ms,
                           busy_ms=ms * 0.9 if busy_ms is None else busy_ms, mem_allocated_bytes=reserved,
                           mem_reserved_bytes=reserved, mem_peak_bytes=reserved, spilled_bytes=0, limits_seq=seq))

    def drain_types(self) -> list[str]:
        """Types of the messages waiting now, consumed."""
        out = []
        while self.sock.poll(0):
            out.append(p.decode(self.sock.recv_multipart(), p.SIDECAR_TO_AGENT).type)
        return out

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def wait_for(pred, timeout_s: float = 5.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def job_of(state: p.NodeStateReply, job_id: str) -> p.JobState:
    return next(j for j in state.jobs if j.job_id == job_id)


# --- control plane ----------------------------------------------------------------------------

def test_ping_and_node_state_reports_emulation(sidecar, sockdir):
    client.ping(sockdir)
    st = client.node_state(sockdir)
    assert st.node == "n1" and st.telemetry == "emulated"
    assert [g.index for g in st.gpus] == [0, 1]
    assert all(g.memory_total_bytes == GPU_MB * MiB for g in st.gpus)


def test_unreachable_sidecar_is_a_typed_error(sockdir):
    with pytest.raises(client.SidecarUnreachable, match="no sidecar control socket"):
        client.node_state(sockdir)
    # A socket file with nobody serving it: the timeout path.
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind(p.ipc(p.control_path(sockdir)))
    try:
        with pytest.raises(client.SidecarUnreachable, match="did not answer"):
            client.node_state(sockdir, timeout_s=0.3)
    finally:
        s.close(0)
        ctx.term()


@pytest.mark.parametrize("no_room", ["wait", "fallback", "observe-only"])
def test_an_opportunistic_job_without_room_is_answered_wait_and_not_registered(sockdir, no_room):
    """opportunistic.no_room: wait: a job no GPU qualifies for is not placed beside a busy guaranteed
    job (the Prolog requeues it); a Prolog that cannot requeue (no may_wait) still gets a GPU. With
    sidecar.enforce: false (observe only) nothing is refused."""
    base = make_config(gpus=1, window_s=0.5).model_dump(mode="json")
    if no_room == "observe-only":
        base["sidecar"]["enforce"] = False
    conf = cfgmod.parse({**base, "opportunistic": {**base["opportunistic"],
                                                   "no_room": "fallback" if no_room == "fallback" else "wait"}})
    r = Running(sockdir, conf)
    a = None
    try:
        g = client.register_job(sockdir, "100", uid=0, user="root", job_class="guaranteed", gpus=1,
                                physical_gpus=[0])
        a = SimAgent(g.endpoint, "100", "guaranteed")
        a.register()
        a.report(100.0, 8 * GiB)
        wait_for(lambda: client.node_state(sockdir).gpus[0].memory_used_bytes == 8 * GiB, what="report seen")
        wait_measured(sockdir, 0)
        o = client.register_job(sockdir, "200", uid=0, user="root", job_class="opportunistic", gpus=1,
                                may_wait=True)
        jobs = {j.job_id for j in client.node_state(sockdir).jobs}
        if no_room != "wait":
            assert (o.gpus, o.placement) == ([0], "fallback") and jobs == {"100", "200"}
            return
        assert (o.gpus, o.endpoint, o.placement) == ([], "", "wait")
        assert "utilisation 0.90 > 0.80" in o.note and "waits for room" in o.note
        assert jobs == {"100"}
        assert not os.path.exists(os.path.join(sockdir, "jobs", "200"))
        assert r.sidecar.placement_waits == 1
        # An older Prolog (no may_wait) never sees a placement it does not know.
        old = client.register_job(sockdir, "201", uid=0, user="root", job_class="opportunistic", gpus=1)
        assert (old.gpus, old.placement) == ([0], "fallback")
        # Once the guaranteed job is gone the GPU qualifies and the requeued job is placed.
        client.retire_job(sockdir, "100")
        again = client.register_job(sockdir, "200", uid=0, user="root", job_class="opportunistic", gpus=1,
                                    may_wait=True)
        assert (again.gpus, again.placement) == ([0], "fit")
    finally:
        if a is not None:
            a.close()
        r.stop()


def test_no_opportunistic_job_beside_a_guaranteed_job_its_window_does_not_show_yet(sockdir):
    """A guaranteed job's GPU looks idle until its first iterations fill the utilisation window (the
    replay on the devcluster placed opportunistic jobs beside jobs that were only starting). Until its
    agent has reported for a window, or, with no agent, until the agent's grace plus a window, the GPU
    takes no opportunistic job, in the placement and in what the coordinator is told."""
    r = Running(sockdir, make_config(gpus=1, window_s=1.0, compliance_grace_s=2.0))
    a = None
    try:
        g = client.register_job(sockdir, "100", uid=0, user="root", job_class="guaranteed", gpus=1,
                                physical_gpus=[0])
        assert client.node_state(sockdir).gpus[0].util_measured is False
        assert r.sidecar._node_report().gpus[0].util_measured is False
        o = client.register_job(sockdir, "200", uid=0, user="root", job_class="opportunistic", gpus=1,
                                may_wait=True)
        assert (o.gpus, o.placement) == ([], "wait") and "not measured" in o.note, o
        # A light guaranteed job: once its reports fill a window, its GPU takes opportunistic work.
        a = SimAgent(g.endpoint, "100", "guaranteed")
        a.register()
        a.report(100.0, 2 * GiB, busy_ms=5.0)  # 5 %: the 2 % slowdown target leaves it 0.4 of the GPU
        first = time.monotonic()
        wait_measured(sockdir, 0)
        assert time.monotonic() - first >= 0.9  # a window after the first report, not at it
        assert r.sidecar._node_report().gpus[0].util_measured is True
        o = client.register_job(sockdir, "200", uid=0, user="root", job_class="opportunistic", gpus=1,
                                may_wait=True)
        assert (o.gpus, o.placement) == ([0], "fit"), o
        # A guaranteed job whose agent never reports is measured by NVML alone after the agent's
        # grace (sidecar.compliance_grace_s) plus a window.
        client.register_job(sockdir, "101", uid=0, user="root", job_class="guaranteed", gpus=1, physical_gpus=[0])
        t0 = time.monotonic()
        assert client.node_state(sockdir).gpus[0].util_measured is False
        wait_measured(sockdir, 0)
        assert time.monotonic() - t0 >= 2.5
    finally:
        if a is not None:
            a.close()
        r.stop()


@pytest.fixture
def quick_window_sidecar(sockdir):
    r = Running(sockdir, make_config(window_s=0.5))
    yield r
    r.stop()


def test_register_guaranteed_and_opportunistic_placement(quick_window_sidecar, sockdir):
    g = client.register_job(sockdir, "100", uid=0, user="root", job_class="guaranteed", gpus=1, physical_gpus=[0])
    assert (g.gpus, g.placement, g.note) == ([0], "requested", "")
    assert g.endpoint == "ipc://" + os.path.join(sockdir, "jobs", "100", "agent.sock")
    # GPU 0 already holds a guaranteed job using memory; GPU 1 is empty: most spare memory wins.
    a = SimAgent(g.endpoint, "100", "guaranteed")
    try:
        a.register()
        a.report(100.0, 8 * GiB)
        wait_for(lambda: client.node_state(sockdir).gpus[0].memory_used_bytes == 8 * GiB, what="report seen")
        wait_measured(sockdir, 0)
        o = client.register_job(sockdir, "200", uid=0, user="root", job_class="opportunistic", gpus=1)
        assert (o.gpus, o.placement) == ([1], "fit")
        o2 = client.register_job(sockdir, "201", uid=0, user="root", job_class="opportunistic", gpus=1)
        assert o2.gpus == [1]  # still more spare memory than GPU 0
        # GPU 1 is now full (2 slots); GPU 0 has room but its guaranteed job keeps it busier than the
        # threshold: Slurm already allocated the job, so it goes there, and says why.
        o3 = client.register_job(sockdir, "202", uid=0, user="root", job_class="opportunistic", gpus=1)
        assert (o3.gpus, o3.placement) == ([0], "fallback") and "utilisation 0.90 > 0.80" in o3.note, o3
        # Both GPUs have their opportunistic slots... GPU 0 has one left; fill it, then fall back.
        client.register_job(sockdir, "203", uid=0, user="root", job_class="opportunistic", gpus=1)
        fb = client.register_job(sockdir, "204", uid=0, user="root", job_class="opportunistic", gpus=1)
        assert fb.placement == "fallback" and len(fb.gpus) == 1
        assert "opportunistic slots taken" in fb.note or "utilisation 0.90 > 0.80" in fb.note
        st = client.node_state(sockdir)
        assert {j.job_id for j in st.jobs} == {"100", "200", "201", "202", "203", "204"}
    finally:
        a.close()


def test_register_is_idempotent_and_retire_twice_is_fine(sidecar, sockdir):
    r1 = client.register_job(sockdir, "300", uid=0, user="root", job_class="opportunistic", gpus=1)
    r2 = client.register_job(sockdir, "300", uid=0, user="root", job_class="opportunistic", gpus=1)
    assert r1.gpus == r2.gpus and r1.endpoint == r2.endpoint
    assert client.retire_job(sockdir, "300") is True
    assert not os.path.exists(os.path.join(sockdir, "jobs", "300"))
    assert client.retire_job(sockdir, "300") is False


def test_control_errors_are_specific(sidecar, sockdir):
    with pytest.raises(client.SidecarError) as ei:
        client.register_job(sockdir, "1", uid=0, user="r", job_class="guaranteed", gpus=1)
    assert ei.value.code == "bad_value" and "physical_gpus is required" in ei.value.message
    with pytest.raises(client.SidecarError, match="out of range; node n1 has GPUs 0-1"):
        client.register_job(sockdir, "1", uid=0, user="r", job_class="guaranteed", gpus=1, physical_gpus=[5])
    with pytest.raises(client.SidecarError, match="must be null for opportunistic"):
        client.register_job(sockdir, "1", uid=0, user="r", job_class="opportunistic", gpus=1, physical_gpus=[0])


# --- agents, limits, preemption -----------------------------------------------------------------

@pytest.fixture
def one_gpu_sidecar(sockdir):
    r = Running(sockdir, make_config(gpus=1))
    yield r
    r.stop()


def _guaranteed_reporting(sockdir) -> SimAgent:
    """Job 100, guaranteed on GPU 0, registered, its first report (100 ms, 2 GiB) seen by the sidecar."""
    g = client.register_job(sockdir, "100", uid=0, user="r", job_class="guaranteed", gpus=1, physical_gpus=[0])
    ga = SimAgent(g.endpoint, "100", "guaranteed")
    try:
        ga.register()
        ga.report(100.0, 2 * GiB)
        wait_for(lambda: job_of(client.node_state(sockdir), "100").iteration_ms == 100.0, what="guaranteed report")
    except BaseException:
        ga.close()
        raise
    return ga


def _opportunistic_beside(sockdir):
    """Job 200, opportunistic, placed on GPU 0 beside job 100; its agent and its registration reply."""
    o = client.register_job(sockdir, "200", uid=0, user="r", job_class="opportunistic", gpus=1)
    assert o.gpus == [0]
    oa = SimAgent(o.endpoint, "200")
    try:
        return oa, oa.register().body
    except BaseException:
        oa.close()
        raise


def test_agent_gets_limits_that_follow_guaranteed_demand_and_preemption(one_gpu_sidecar, sockdir):
    ga = _guaranteed_reporting(sockdir)
    oa = None
    try:
        oa, reg = _opportunistic_beside(sockdir)
        assert reg.job_class == "opportunistic" and reg.throttle != "off" and reg.heartbeat_s == 0.2
        headroom = 512 * MiB
        assert reg.mem_limit_bytes == GPU_MB * MiB - 2 * GiB - headroom
        assert 0 < reg.compute_share < 1
        # The guaranteed job grows to 10 GiB: the opportunistic limit shrinks at once.
        ga.report(100.0, 10 * GiB)
        lim = oa.recv("limits").body
        assert lim.mem_limit_bytes == GPU_MB * MiB - 10 * GiB - headroom
        assert lim.seq > reg.seq and lim.compute_share < reg.compute_share
        oa.send(p.Ack(seq=lim.seq, applied_iteration=3))
        wait_for(lambda: job_of(client.node_state(sockdir), "200").acked_seq == lim.seq, what="ack recorded")
        # 15 GiB leaves less than the 1 GiB minimum: preemption notice, and node_state shows it.
        ga.report(100.0, 15 * GiB)
        pre = oa.recv("preempt").body
        assert pre.grace_s == 30 and pre.deadline_unix > time.time() + 20 and "GPU 0" in pre.reason
        st = client.node_state(sockdir)
        assert [x.job_id for x in st.preemptions] == ["200"]
        js = job_of(st, "200")
        assert js.mem_limit_bytes == 1 * GiB and js.agents == 1
        assert job_of(st, "100").mem_limit_bytes is None and job_of(st, "100").compute_share == 1.0
    finally:
        ga.close()
        if oa is not None:
            oa.close()


def test_a_burst_pauses_a_pausable_job_in_place_and_it_resumes_once_the_burst_has_passed(sockdir):
    """The preemption ladder on the real sidecar: the guaranteed job's burst leaves the opportunistic one less
    than its minimum; its agent can pause, so it is paused (no preemption), shown paused, not held to
    compliance, and resumed after the burst has been over for sidecar.resume_hold_s."""

    r = Running(sockdir, make_config(gpus=1, resume_hold_s=1.0, compliance_grace_s=0.5))
    ga = oa = None
    try:
        ga = _guaranteed_reporting(sockdir)
        o = client.register_job(sockdir, "200", uid=0, user="r", job_class="opportunistic", gpus=1)
        oa = SimAgent(o.endpoint, "200", features=(p.FEATURE_PAUSE,))
        oa.register()
        oa.report(100.0, 2 * GiB)
        ga.report(100.0, 15 * GiB)  # the burst: 16 GiB GPU, 512 MiB headroom, 1 GiB minimum
        pause = oa.recv("pause").body
        assert pause.seq == 1 and "guaranteed demand 15360 MiB" in pause.reason
        oa.send(p.Paused(seq=1, bytes_freed=2 * GiB, bytes_moved=2 * GiB, pause_ms=3.0))
        wait_for(lambda: job_of(client.node_state(sockdir), "200").paused, what="paused shown")
        st = client.node_state(sockdir)
        assert st.preemptions == []

        def alive_for(seconds: float) -> None:  # heartbeats, as live agents send them
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                ga.send(p.Heartbeat())
                oa.send(p.Heartbeat())
                time.sleep(0.1)

        alive_for(1.0)  # past compliance_grace_s with limits unacknowledged: a paused job is compliant
        assert client.node_state(sockdir).preemptions == [] and r.sidecar.noncompliant_total == 0
        ga.report(100.0, 2 * GiB)  # the burst is over
        t0 = time.monotonic()
        alive_for(0.8)
        assert not any(m == "resume" for m in oa.drain_types())  # held for resume_hold_s first
        alive_for(0.5)
        resume = oa.recv("resume", timeout_s=5).body
        assert resume.seq == 1 and time.monotonic() - t0 >= 0.9
        oa.send(p.Resumed(seq=1, resume_ms=2.0))
        wait_for(lambda: not job_of(client.node_state(sockdir), "200").paused, what="resumed shown")
        v = r.sidecar.metrics_view()
        assert v.pauses == 1 and v.pause_bytes_moved == 2 * GiB and v.pause_seconds > 0.5
    finally:
        for a in (ga, oa):
            if a is not None:
                a.close()
        r.stop()


def test_observe_only_sidecar_measures_but_never_limits_or_preempts(sockdir):
    """sidecar.enforce: false, the scenario above: the same placement and measurements, but the
    opportunistic job keeps unlimited memory and a full share, and no preemption follows."""
    r = Running(sockdir, make_config(gpus=1, enforce=False))
    ga = oa = None
    try:
        ga = _guaranteed_reporting(sockdir)
        oa, reg = _opportunistic_beside(sockdir)
        assert reg.job_class == "opportunistic"
        assert (reg.mem_limit_bytes, reg.compute_share) == (None, 1.0)
        oa.report(50.0, 3 * GiB)
        ga.report(100.0, 15 * GiB)  # with enforcement: a shrink, then a preemption notice
        wait_for(lambda: client.node_state(sockdir).gpus[0].memory_used_bytes >= 15 * GiB, what="telemetry")
        with pytest.raises(AssertionError):
            oa.recv("limits", timeout_s=1.0)
        st = client.node_state(sockdir)
        assert st.preemptions == []
        assert (job_of(st, "200").mem_limit_bytes, job_of(st, "200").compute_share) == (None, 1.0)
    finally:
        for agent in (ga, oa):
            if agent is not None:
                agent.close()
        r.stop()


def test_report_before_register_and_wrong_job(sidecar, sockdir):
    r = client.register_job(sockdir, "400", uid=0, user="r", job_class="opportunistic", gpus=1)
    a = SimAgent(r.endpoint, "400")
    try:
        a.report(10.0, 1)
        err = a.recv("error")
        assert err.body.code == "not_registered"
        a.job_id = "401"
        a.send(p.Register(job_id="401", pid=os.getpid(), rank=0, local_rank=0, world_size=1, hostname="h",
                          agent_version="s", torch_version="t", device="cpu", job_class="none"))
        err = a.recv("error")
        assert err.body.code == "forbidden" and "serves job 400" in err.body.message
    finally:
        a.close()


def test_sidecar_heartbeats_and_forgets_vanished_agent(sidecar, sockdir):
    r = client.register_job(sockdir, "500", uid=0, user="r", job_class="opportunistic", gpus=1)
    a = SimAgent(r.endpoint, "500")
    a.register()
    a.recv("heartbeat", timeout_s=3)
    assert job_of(client.node_state(sockdir), "500").agents == 1
    a.close()  # vanishes without bye; 5 heartbeats (1 s) later it is no longer counted
    wait_for(lambda: job_of(client.node_state(sockdir), "500").agents == 0, timeout_s=5, what="agent expiry")
    client.ping(sockdir)


def test_version_mismatch_reply_names_versions(sidecar, sockdir):
    r = client.register_job(sockdir, "600", uid=0, user="r", job_class="opportunistic", gpus=1)
    a = SimAgent(r.endpoint, "600")
    try:
        env = {"v": 2, "type": "register", "id": "x1", "ts": 0, "ref": None, "body": {}}
        a.send_raw([p.MARKER, json.dumps(env).encode()])
        err = a.recv("error")
        assert err.body.code == "version_mismatch" and err.ref == "x1"
        assert "peer speaks antman protocol v2, this side speaks v1" in err.body.message
    finally:
        a.close()


def test_malformed_control_requests_get_error_codes(sidecar, sockdir):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(p.ipc(p.control_path(sockdir)))
    cases = [
        ([b"hello"], "bad_frames"),
        ([p.MARKER, b"{"], "bad_json"),
        ([p.MARKER, json.dumps({"v": 1, "type": "limits", "id": "a", "ts": 0, "ref": None,
                                "body": {"seq": 1, "mem_limit_bytes": None, "compute_share": 1}}).encode()],
         "wrong_direction"),
        ([p.MARKER, json.dumps({"v": 1, "type": "job_retire", "id": "b", "ts": 0, "ref": None,
                                "body": {"job_id": 7}}).encode()], "bad_type"),
    ]
    try:
        for frames, code in cases:
            s.send_multipart(frames)
            assert s.poll(3000), f"no answer to {frames}"
            msg = p.decode(s.recv_multipart(), p.CONTROL_REPLIES)
            assert msg.type == "error" and msg.body.code == code, (frames, msg)
    finally:
        s.close(0)
        ctx.term()


def test_fuzzed_streams_leave_sidecar_answering(sidecar, sockdir):
    r = client.register_job(sockdir, "700", uid=0, user="r", job_class="opportunistic", gpus=1)
    rng = random.Random(1234)
    ctx = zmq.Context()
    socks = []
    for ep in (r.endpoint, p.ipc(p.control_path(sockdir))):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(ep)
        socks.append(s)
    good = json.loads(p.encode(p.message(p.Report(
        iteration=1, iterations=1, iteration_ms=1.0, busy_ms=1.0, mem_allocated_bytes=0, mem_reserved_bytes=0,
        mem_peak_bytes=0, spilled_bytes=0, limits_seq=0)))[1])

    def mutant() -> list[bytes]:
        kind = rng.randrange(4)
        if kind == 0:
            return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 4))]
        env = json.loads(json.dumps(good))
        if kind == 1:
            env["body"][rng.choice(list(env["body"]))] = rng.choice([None, -1, "x", [], {}, 1e308, True])
        elif kind == 2:
            env[rng.choice(list(env))] = rng.choice([None, 2, "y", [1], {"a": 1}])
        else:
            env["type"] = rng.choice(sorted(p.BODY_TYPES))
        raw = json.dumps(env).encode()
        if rng.random() < 0.2:
            raw = raw[: rng.randrange(len(raw))]
        return [p.MARKER, raw]
    try:
        for _ in range(400):
            rng.choice(socks).send_multipart(mutant())
        # Answers came back for what could be answered; the sidecar still serves both sides.
        time.sleep(0.3)
        client.ping(sockdir)
        assert job_of(client.node_state(sockdir), "700").agents == 0
        a = SimAgent(r.endpoint, "700")
        try:
            assert a.register().body.job_id == "700"
        finally:
            a.close()
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
    assert sidecar.thread.is_alive()


# --- permissions, restart, locking ------------------------------------------------------------

def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="permission checks need root (chown to another uid)")
def test_socket_dir_permissions_isolate_jobs(sidecar, sockdir):
    assert _mode(p.control_path(sockdir)) == 0o600 and os.stat(p.control_path(sockdir)).st_uid == 0
    assert _mode(os.path.join(sockdir, "jobs")) == 0o711
    mine = client.register_job(sockdir, "800", uid=NOBODY, user="nobody", job_class="opportunistic", gpus=1)
    other = client.register_job(sockdir, "801", uid=0, user="root", job_class="opportunistic", gpus=1)
    jd = os.path.join(sockdir, "jobs", "800")
    st = os.stat(jd)
    assert (st.st_uid, _mode(jd)) == (0, 0o711)  # root's: the user cannot swap what is in it
    sst = os.stat(os.path.join(jd, "agent.sock"))
    assert (sst.st_uid, stat.S_IMODE(sst.st_mode)) == (NOBODY, 0o600)
    # As the job's user (a real setuid child): its own endpoint connects, the other job's and the
    # control socket do not.
    probe = (
        "import socket, sys\n"
        "def try_(p):\n"
        "    s = socket.socket(socket.AF_UNIX)\n"
        "    try:\n        s.connect(p); return 'ok'\n"
        "    except PermissionError: return 'denied'\n"
        "    except OSError as e: return type(e).__name__\n"
        "print(try_(sys.argv[1]), try_(sys.argv[2]), try_(sys.argv[3]))\n")
    # The job's user cannot run root's interpreter (under /root); any python3 that user can run will do.
    py = next((x for x in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(x, os.X_OK)), None)
    if py is None:
        pytest.skip("no system python3 the unprivileged user can run")
    out = subprocess.run(
        [py, "-c", probe, mine.endpoint[6:], other.endpoint[6:], p.control_path(sockdir)],
        capture_output=True, text=True, timeout=30, user=NOBODY, group=NOBODY, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "denied", "denied"]


@pytest.mark.skipif(os.geteuid() != 0, reason="permission checks need root (chown to another uid)")
def test_a_job_cannot_make_root_chown_a_file_through_its_socket(sidecar, sockdir, tmp_path):
    """The audit's race: agent.sock swapped for a symlink so that root's chmod/chown hits the target.
    The user cannot touch its job directory any more, and a link planted beforehand (a directory an
    older sidecar gave the user) is removed, never followed."""
    target = tmp_path / "precious"
    target.write_text("root's")
    os.chmod(target, 0o600)
    jd = os.path.join(sockdir, "jobs", "802")
    os.makedirs(jd)
    os.chown(jd, NOBODY, NOBODY)
    os.symlink(target, os.path.join(jd, "agent.sock"))
    r = client.register_job(sockdir, "802", uid=NOBODY, gid=NOBODY, user="nobody", job_class="opportunistic", gpus=1)
    tst = os.stat(target)
    assert (tst.st_uid, stat.S_IMODE(tst.st_mode)) == (0, 0o600) and target.read_text() == "root's"
    assert os.stat(jd).st_uid == 0 and stat.S_ISSOCK(os.lstat(r.endpoint[6:]).st_mode)
    py = next((x for x in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(x, os.X_OK)), None)
    if py is None:
        pytest.skip("no system python3 the unprivileged user can run")
    swap = ("import os, sys\n"
            "try:\n    os.unlink(sys.argv[1]); os.symlink(sys.argv[2], sys.argv[1]); print('swapped')\n"
            "except PermissionError:\n    print('denied')\n")
    out = subprocess.run([py, "-c", swap, r.endpoint[6:], str(target)], capture_output=True, text=True, timeout=30,
                         user=NOBODY, group=NOBODY, cwd="/")
    assert out.stdout.strip() == "denied", (out.stdout, out.stderr)


def test_restart_serves_reregistrations(sockdir):
    first = Running(sockdir)
    try:
        r = client.register_job(sockdir, "900", uid=0, user="r", job_class="opportunistic", gpus=1)
        a = SimAgent(r.endpoint, "900")
        a.register()
    finally:
        first.stop()
    a.recv("bye")  # the stopping sidecar says goodbye
    second = Running(sockdir)
    try:
        st = client.node_state(sockdir)
        assert [j.job_id for j in st.jobs] == ["900"] and job_of(st, "900").gpus == r.gpus
        # The agent's DEALER reconnects by itself; its next report is answered by "register first".
        a.report(10.0, 1)
        assert a.recv("error").body.code == "not_registered"
        assert a.register().body.job_id == "900"
        # A retried Prolog gets the same answer from the new sidecar.
        r2 = client.register_job(sockdir, "900", uid=0, user="r", job_class="opportunistic", gpus=1)
        assert (r2.gpus, r2.endpoint) == (r.gpus, r.endpoint)
        assert job_of(client.node_state(sockdir), "900").agents == 1
    finally:
        a.close()
        second.stop()


def test_second_sidecar_on_same_dir_is_refused(sidecar, sockdir):
    from slurm_antman.sidecar.endpoints import SocketDirError
    other = build(make_config(), "n1", sockdir)
    with pytest.raises(SocketDirError, match="another sidecar is running"):
        other.start()
    other.close()
    client.ping(sockdir)


def test_huge_and_nested_numbers_from_a_job_never_stop_the_sidecar(sidecar, sockdir):
    """The audit's reproduction: a job opens two agent connections to its own socket, registers twice
    and reports the largest numbers it can. Every number is bounded on the wire (2^53); what the
    sidecar sums from them is still sent, or dropped with a log line, never raised out of the loop;
    a 4,300-digit number and deeply nested JSON are refused with an error. The node keeps serving."""
    r = client.register_job(sockdir, "800", uid=0, user="r", job_class="opportunistic", gpus=1)
    agents = [SimAgent(r.endpoint, "800") for i in range(2)]
    raw = SimAgent(r.endpoint, "800")
    try:
        for a in agents:
            a.register()
            a.report(1.0, p.MAX_NUMBER)
        too_big = json.loads(p.encode(p.message(p.Report(
            iteration=1, iterations=1, iteration_ms=1.0, busy_ms=1.0, mem_allocated_bytes=0, mem_reserved_bytes=0,
            mem_peak_bytes=0, spilled_bytes=0, limits_seq=0)))[1])
        too_big["body"]["mem_reserved_bytes"] = p.MAX_NUMBER + 1
        raw.send_raw([p.MARKER, json.dumps(too_big).encode()])
        assert "out of range" in raw.recv("error").body.message
        for n, answer in ((4300, "integer of 14285 bits is out of range"), (5000, "not valid UTF-8 JSON")):
            # 4,300 digits: the most Python converts; one more and json refuses the envelope
            raw.send_raw([p.MARKER, json.dumps(too_big).replace(str(p.MAX_NUMBER + 1), "9" * n).encode()])
            assert answer in raw.recv("error").body.message
        raw.send_raw([p.MARKER, b"[" * 100_000 + b"]" * 100_000])
        assert "nested too deeply" in raw.recv("error").body.message
        time.sleep(0.5)  # several ticks: sampling, policy, metrics with the summed numbers
        client.ping(sockdir)
        assert sidecar.thread.is_alive()
        st = client.node_state(sockdir)
        assert job_of(st, "800").agents == 2
        nxt = client.register_job(sockdir, "801", uid=0, user="r", job_class="guaranteed", gpus=1, physical_gpus=[0])
        assert nxt.placement == "requested"
    finally:
        for a in (*agents, raw):
            a.close()


def test_a_job_cannot_flood_its_sidecar_with_agents_or_oversized_frames(sidecar, sockdir):
    """At most MAX_AGENTS_PER_GPU agents per GPU of the job; a frame over the protocol's limit gets its
    sender disconnected unread. The job's real agent and the node keep being served."""
    from slurm_antman.sidecar.agent_channel import MAX_AGENTS_PER_GPU

    r = client.register_job(sockdir, "900", uid=0, user="r", job_class="opportunistic", gpus=1)
    agents = [SimAgent(r.endpoint, "900") for i in range(MAX_AGENTS_PER_GPU + 1)]
    big = SimAgent(r.endpoint, "900")
    try:
        for a in agents[:-1]:
            a.register()
        agents[-1].send(p.Register(job_id="900", pid=os.getpid(), rank=0, local_rank=0, world_size=1, hostname="n1",
                                   agent_version="sim", torch_version="none", device="cuda",
                                   job_class="opportunistic"))
        err = agents[-1].recv("error").body
        assert err.code == "forbidden" and f"{MAX_AGENTS_PER_GPU} per GPU" in err.message
        assert job_of(client.node_state(sockdir), "900").agents == MAX_AGENTS_PER_GPU
        big.send_raw([p.MARKER, b" " * (2 * p.MAX_MESSAGE_BYTES)])
        time.sleep(0.3)
        client.ping(sockdir)
        agents[0].report(1.0, 1 * GiB)
        wait_for(lambda: job_of(client.node_state(sockdir), "900").mem_used_bytes == 1 * GiB, what="report seen")
    finally:
        for a in (*agents, big):
            a.close()


@pytest.mark.parametrize("misbehaviour", ["ignores its limits", "holds more memory than its limit"])
def test_a_noncompliant_opportunistic_job_beside_a_guaranteed_one_is_asked_to_go(sockdir, misbehaviour):
    """Enforcement that does not need the job's goodwill: an agent that does not acknowledge
    its new limits, or keeps more memory than its limit, for longer than sidecar.compliance_grace_s
    is sent away (here without a coordinator: the notice; with one, a requeue at once, see
    test_uplink_sidecar). A compliant neighbour is left alone."""
    r = Running(sockdir, make_config(gpus=1, compliance_grace_s=0.5))
    ga = oa = None
    try:
        ga = _guaranteed_reporting(sockdir)
        oa, reg = _opportunistic_beside(sockdir)
        if misbehaviour == "ignores its limits":
            ga.report(100.0, 10 * GiB)          # its limit shrinks; it never acknowledges
            oa.recv("limits")
        else:
            oa.report(100.0, reg.mem_limit_bytes + 2 * GiB)  # acknowledged, but over by 2 GiB
        t0 = time.monotonic()
        pre = oa.recv("preempt", timeout_s=10).body
        assert time.monotonic() - t0 >= 0.4  # not before the grace time
        assert "non-compliant" in pre.reason
        assert ("acknowledge" in pre.reason) if misbehaviour == "ignores its limits" else ("over its limit" in pre.reason)
        assert r.sidecar.noncompliant_total == 1 and "200" in r.sidecar.noncompliant
        assert job_of(client.node_state(sockdir), "100").compute_share == 1.0  # the guaranteed job untouched
    finally:
        for a in (ga, oa):
            if a is not None:
                a.close()
        r.stop()


def test_a_full_state_directory_costs_the_restart_record_not_the_job(sidecar, sockdir):
    """A fault at the sidecar: its state directory full (a real tmpfs, filled). The job is
    still registered, placed and limited, its agent served; only the record a restarted sidecar
    would read is missing, counted in a metric, and no partial file takes the space."""

    state = os.path.join(sockdir, "state")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", state], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs for the test (run as root): {r.stderr.strip()}")
    try:
        with open(os.path.join(state, "filler"), "wb", buffering=0) as f:
            with pytest.raises(OSError):
                while True:
                    f.write(b"\0" * 1024)
        reply = client.register_job(sockdir, "901", uid=0, user="r", job_class="opportunistic", gpus=1)
        assert reply.placement != "wait" and reply.endpoint
        a = SimAgent(reply.endpoint, "901")
        try:
            assert a.register().body.mem_limit_bytes > 0
        finally:
            a.close()
        assert [j.job_id for j in client.node_state(sockdir).jobs] == ["901"]
        assert sidecar.sidecar.metrics_view().state_write_errors == 1
        assert sorted(os.listdir(state)) == ["filler"]
        # The node says why it takes no new opportunistic job, and a Prolog that can requeue is told to.
        assert client.node_state(sockdir).unhealthy.startswith(f"{state} is full")
        waited = client.register_job(sockdir, "902", uid=0, user="r", job_class="opportunistic", gpus=1,
                                     may_wait=True)
        assert waited.placement == "wait" and "takes no new opportunistic job" in waited.note
        os.unlink(os.path.join(state, "filler"))
        wait_for(lambda: client.node_state(sockdir).unhealthy == "", 10, "the node healthy again")
        again = client.register_job(sockdir, "902", uid=0, user="r", job_class="opportunistic", gpus=1,
                                    may_wait=True)
        assert again.placement != "wait"
    finally:
        subprocess.run(["umount", "-l", state], check=True)


def test_driver_caps_follow_an_opportunistic_jobs_limit_and_are_lifted_when_it_leaves(sidecar, sockdir, tmp_path):
    """Where the driver has memory caps (MPS v3; set for real by the gpu test in test_driver_caps.py),
    the sidecar caps each opportunistic job's Slurm cgroup at its limit plus compliance's tolerance and
    lifts the cap when the job retires. Here only the NVML call itself is recorded instead of made:
    the cgroup comes from the agent's real pid through a /proc and cgroup tree laid out as Slurm's."""
    import pynvml

    from slurm_antman.sidecar import driver_caps

    calls = []

    class RecordingCaps(driver_caps.MemoryCaps):
        def _call(self, gpu, cgroup_dir, soft, hard):
            calls.append((gpu, cgroup_dir, soft, hard))

    proc, root = tmp_path / "proc", tmp_path / "cg"
    (proc / str(os.getpid())).mkdir(parents=True)
    (proc / str(os.getpid()) / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_903/step_0/user/task_0\n")
    (root / "system.slice/slurmstepd.scope/job_903").mkdir(parents=True)
    sc = sidecar.sidecar
    sc.caps = RecordingCaps(pynvml, driver_caps.Support("", "dmem"), cgroup_root=str(root), proc=str(proc))
    reply = client.register_job(sockdir, "903", uid=0, user="r", job_class="opportunistic", gpus=1)
    a = SimAgent(reply.endpoint, "903")
    try:
        limit = a.register().body.mem_limit_bytes
        a.report(10.0, 1 << 20)
        wait_for(lambda: calls, 5, "the cap")
        tol = sc.opt.compliance
        assert calls[0] == (reply.gpus[0], str(root / "system.slice/slurmstepd.scope/job_903"), 0,
                            int(limit * (1 + tol.mem_tolerance)) + tol.mem_slack_bytes)
        time.sleep(0.5)
        assert len(calls) == 1  # set once, not every tick
    finally:
        a.close()
    client.retire_job(sockdir, "903")
    wait_for(lambda: len(calls) == 2, 5, "the cap lifted")
    assert calls[1][3] == pynvml.NVML_DEVICE_MEMORY_LIMIT_MAX and calls[1][:2] == calls[0][:2]
