"""The real sidecar (in-process, emulated telemetry) reporting to a real SidecarHub over CURVE on
127.0.0.1: reports, upgrades via job_class_update, preempt_notice reaching the agent, the coordinator
choosing the victim, and reconnection after the hub restarts."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time

import pytest
import zmq

from slurm_antman import config as cfgmod
from slurm_antman import protocol as p
from slurm_antman import curve_keys as keys
from slurm_antman.coordinator.hub import SidecarHub
from slurm_antman.clients import sidecar_control as client
from slurm_antman.sidecar.cli import build
from slurm_antman.policy.node.core import GiB, MiB
from test_sidecar_daemon import Running, SimAgent, job_of, wait_for
from test_uplink_hub import free_port

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")

GPU_MB = 16384


def make_config(key_dir, port: int, gpus: int = 1, **sidecar) -> cfgmod.AntmanConfig:
    return cfgmod.parse({
        "nodes": [{"name": "n1", "gpus": gpus, "gpu_memory_mb": GPU_MB}],
        "sidecar": {"heartbeat_s": 0.2, "telemetry": "emulated", **sidecar},
        "grace_time_s": 30,
        "coordinator": {"endpoint": f"tcp://127.0.0.1:{port}", "key_dir": str(key_dir), "report_interval_s": 0.2},
    })



@contextlib.contextmanager
def uplinked(tmp_path, **config):
    """A real hub and a real sidecar reporting to it: (config, hub, running sidecar, socket dir)."""
    kd = tmp_path / "keys"
    keys.init_keys(kd, ["n1"])
    conf = make_config(kd, free_port(), **config)
    sockdir = tempfile.mkdtemp(prefix="am-", dir="/tmp")
    hub = SidecarHub(conf)
    hub.start()
    side = Running(sockdir, conf)
    try:
        yield conf, hub, side, sockdir
    finally:
        side.stop()
        hub.close()
        shutil.rmtree(sockdir, ignore_errors=True)


@pytest.fixture
def env(tmp_path):
    with uplinked(tmp_path) as e:
        yield e


def next_report(hub, pred=lambda r: True, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for r in hub.poll(0.1):
            if pred(r):
                return r
    raise AssertionError("no matching node_report")


def rjob(r, job_id):
    return next(j for j in r.jobs if j.job_id == job_id)


def test_reports_arrive_with_node_state(env):
    conf, hub, side, sockdir = env
    g = client.register_job(sockdir, "100", uid=0, user="r", job_class="guaranteed", gpus=1, physical_gpus=[0])
    r = next_report(hub, lambda r: any(j.job_id == "100" for j in r.jobs))
    assert r.node == "n1" and r.telemetry == "emulated"
    assert [(gpu.index, gpu.mem_total_bytes, gpu.jobs) for gpu in r.gpus] == [(0, GPU_MB * MiB, ["100"])]
    j = rjob(r, "100")
    assert (j.job_class, j.gpus, j.mem_limit_bytes, j.compute_share, j.mem_used_bytes) == (
        "guaranteed", [0], None, 1.0, None)
    assert r.preempt_requests == []
    a = SimAgent(g.endpoint, "100", "guaranteed")
    try:
        a.register()
        a.report(80.0, 3 * GiB)
        r = next_report(hub, lambda r: rjob(r, "100").iteration_ms == 80.0)
        assert rjob(r, "100").mem_used_bytes == 3 * GiB and r.gpus[0].mem_used_bytes == 3 * GiB
    finally:
        a.close()


def test_job_class_update_unthrottles_the_job_and_survives_restart(env, tmp_path):
    conf, hub, side, sockdir = env
    o = client.register_job(sockdir, "200", uid=0, user="r", job_class="opportunistic", gpus=1)
    a = SimAgent(o.endpoint, "200")
    try:
        reg = a.register().body
        assert reg.mem_limit_bytes is not None  # an opportunistic job is limited
        next_report(hub, lambda r: any(j.job_id == "200" for j in r.jobs))
        assert hub.send("n1", p.JobClassUpdate(job_id="200", job_class="guaranteed"))
        lim = a.recv("limits").body
        assert (lim.mem_limit_bytes, lim.compute_share) == (None, 1.0) and lim.seq > reg.seq
        r = next_report(hub, lambda r: rjob(r, "200").job_class == "guaranteed")
        assert rjob(r, "200").mem_limit_bytes is None
        # A repeated update is harmless: no new limits.
        assert hub.send("n1", p.JobClassUpdate(job_id="200", job_class="guaranteed"))
        next_report(hub)
        with pytest.raises(AssertionError):
            a.recv("limits", timeout_s=0.5)
    finally:
        a.close()
    # The class is part of the job's record: a restarted sidecar keeps it.
    side.stop()
    restarted = Running(sockdir, conf)
    side.sidecar, side.thread = restarted.sidecar, restarted.thread  # the fixture stops this one
    assert job_of(client.node_state(sockdir), "200").job_class == "guaranteed"
    r = next_report(hub, lambda r: any(j.job_id == "200" for j in r.jobs))
    assert rjob(r, "200").job_class == "guaranteed"


def test_commands_for_unknown_jobs_are_refused(env, caplog):
    conf, hub, side, sockdir = env
    caplog.set_level(logging.WARNING)
    next_report(hub)
    assert hub.send("n1", p.JobClassUpdate(job_id="999", job_class="guaranteed"))
    assert hub.send("n1", p.PreemptNotice(job_id="998", grace_s=1, reason="x"))
    client.register_job(sockdir, "100", uid=0, user="r", job_class="guaranteed", gpus=1, physical_gpus=[0])
    assert hub.send("n1", p.PreemptNotice(job_id="100", grace_s=1, reason="x"))
    wait_for(lambda: (hub.poll(0.05), "only opportunistic jobs are preempted" in caplog.text)[1],
             what="bad_value logged")
    assert "job 999 is not registered on node n1" in caplog.text and "job 998" in caplog.text
    assert client.node_state(sockdir).preemptions == []


def test_preemption_request_goes_up_and_the_coordinators_victim_gets_the_notice(env):
    conf, hub, side, sockdir = env
    g = client.register_job(sockdir, "100", uid=0, user="r", job_class="guaranteed", gpus=1, physical_gpus=[0])
    ga = SimAgent(g.endpoint, "100", "guaranteed")
    agents = {}
    try:
        ga.register()
        ga.report(100.0, 2 * GiB)
        for jid in ("200", "201"):
            o = client.register_job(sockdir, jid, uid=0, user="r", job_class="opportunistic", gpus=1)
            agents[jid] = SimAgent(o.endpoint, jid)
            agents[jid].register()
            time.sleep(0.01)  # distinct registration times: 201 is the newest
        # 14 GiB of 16 leave 1.5 GiB after headroom: not the 2 x 1 GiB two opportunistic jobs need.
        ga.report(100.0, 14 * GiB)
        r = next_report(hub, lambda r: r.preempt_requests)
        (req,) = r.preempt_requests
        assert (req.job_id, req.gpu) == ("201", 0) and "GPU 0" in req.reason
        # With an uplink the sidecar only asks; no agent is told to leave yet.
        for a in agents.values():
            with pytest.raises(AssertionError):
                a.recv("preempt", timeout_s=0.3)
        # The coordinator picks 200 (say, it checkpointed most recently).
        before = time.time()
        assert hub.send("n1", p.PreemptNotice(job_id="200", grace_s=7.0, reason="coordinator: job 100 needs GPU 0"))
        pre = agents["200"].recv("preempt").body
        assert pre.grace_s == pytest.approx(7.0) and before + 7 <= pre.deadline_unix <= time.time() + 7
        assert pre.reason == "coordinator: job 100 needs GPU 0"
        # 201 now fits beside the guaranteed job: the sidecar's own request on GPU 0 is withdrawn.
        r = next_report(hub, lambda r: [x.job_id for x in r.preempt_requests] == ["200"])
        assert r.preempt_requests[0].since_unix >= before
        with pytest.raises(AssertionError):
            agents["201"].recv("preempt", timeout_s=0.3)
        assert [x.job_id for x in client.node_state(sockdir).preemptions] == ["200"]
        # A repeated notice keeps the first deadline; an agent registering later is told too.
        assert hub.send("n1", p.PreemptNotice(job_id="200", grace_s=60.0, reason="again"))
        late = SimAgent(agents["200"].sock.getsockopt_string(zmq.LAST_ENDPOINT), "200")
        try:
            late.register()
            assert late.recv("preempt").body.deadline_unix == pytest.approx(pre.deadline_unix)
        finally:
            late.close()
    finally:
        ga.close()
        for a in agents.values():
            a.close()


def test_sidecar_reconnects_after_the_hub_restarts(env):
    conf, hub, side, sockdir = env
    next_report(hub)
    hub.close()
    time.sleep(0.5)  # reports sent meanwhile are dropped, not queued
    hub2 = SidecarHub(conf)
    hub2.start()
    try:
        assert hub2.send("n1", p.JobClassUpdate(job_id="1", job_class="guaranteed")) is False
        r = next_report(hub2, timeout_s=10)
        assert r.node == "n1"
        assert hub2.send("n1", p.JobClassUpdate(job_id="1", job_class="guaranteed")) is True
    finally:
        hub2.close()
    assert side.thread.is_alive()


def test_no_keys_means_no_uplink_and_a_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    conf = make_config(tmp_path / "absent", free_port())
    sc = build(conf, "n1", tempfile.mkdtemp(prefix="am-", dir="/tmp"))
    try:
        assert sc.opt.uplink is None
        assert "no coordinator uplink for node n1" in caplog.text and "antman keys init" in caplog.text
    finally:
        shutil.rmtree(sc.opt.socket_dir, ignore_errors=True)
        sc.telemetry.close()
    caplog.clear()
    plain = cfgmod.parse({"nodes": [{"name": "n1", "gpus": 1}], "sidecar": {"telemetry": "emulated"}})
    sc = build(plain, "n1", "/tmp/am-unused")
    assert sc.opt.uplink is None and "coordinator.key_dir is not set" in caplog.text
    sc.telemetry.close()


def test_placement_memory_keeps_a_moved_job_off_the_gpu_it_left(tmp_path):
    # Two idle GPUs: an opportunistic job goes to GPU 1 (ties go to the highest index). The
    # coordinator moves it off GPU 1; when Slurm requeues it onto this node again, the sidecar
    # places it on GPU 0 and says why. The memory is used once: a later requeue is placed afresh.
    kd = tmp_path / "keys"
    keys.init_keys(kd, ["n1"])
    conf = make_config(kd, free_port(), gpus=2)
    sockdir = tempfile.mkdtemp(prefix="am-", dir="/tmp")
    hub = SidecarHub(conf)
    hub.start()
    side = Running(sockdir, conf)
    try:
        first = client.register_job(sockdir, "300", uid=0, user="r", job_class="opportunistic", gpus=1)
        assert first.gpus == [1] and first.note == ""
        next_report(hub, lambda r: any(j.job_id == "300" for j in r.jobs))
        assert hub.send("n1", p.PreemptNotice(job_id="300", grace_s=5.0, reason="moved: crawling", avoid_gpus=[1]))
        wait_for(lambda: [x.job_id for x in client.node_state(sockdir).preemptions] == ["300"],
                 what="the notice reached the sidecar")
        assert client.retire_job(sockdir, "300")  # Slurm's requeue runs the Epilog
        back = client.register_job(sockdir, "300", uid=0, user="r", job_class="opportunistic", gpus=1)
        assert back.gpus == [0] and back.placement == "fit"
        assert "placement memory: kept off GPU(s) 1" in back.note
        # The coordinator writes the placement it is told into the audit log, once: explain shows it.
        from slurm_antman.coordinator.daemon import Coordinator
        from slurm_antman.coordinator.explain import explain
        from slurm_antman.slurm import CliBackend
        audit_log = tmp_path / "audit.jsonl"
        coord = Coordinator(cfgmod.parse({"nodes": [{"name": "n1", "gpus": 2}],
                                          "coordinator": {"audit_log": str(audit_log)}}),
                            backend=CliBackend(env={"PATH": str(tmp_path)}, timeout=5))
        for _ in range(2):  # the second report of the same placement adds nothing
            coord._take([next_report(hub, lambda r: any(j.job_id == "300" and j.gpus == [0] for j in r.jobs))])
            coord._record_placements({"300": 1})  # Slurm shows it running, requeued once
        coord.audit.close()
        text, rc = explain("300", str(audit_log))
        assert rc == 0 and text.count("placed on n1 GPU(s) [0] by its sidecar (fit)") == 1, text
        assert "why: placement memory: kept off GPU(s) 1" in text
        assert client.retire_job(sockdir, "300")
        again = client.register_job(sockdir, "300", uid=0, user="r", job_class="opportunistic", gpus=1)
        assert again.gpus == [1] and again.note == ""
    finally:
        side.stop()
        hub.close()
        shutil.rmtree(sockdir, ignore_errors=True)


def test_a_noncompliant_job_is_named_to_the_coordinator_not_told_by_the_sidecar(tmp_path):
    """With an uplink the sidecar names the non-compliant job in its report (noncompliant: true), so the
    coordinator requeues that job at once (policy.preemption); the sidecar itself tells the agent nothing."""
    with uplinked(tmp_path, compliance_grace_s=0.5) as (conf, hub, side, sockdir):
        g = client.register_job(sockdir, "100", uid=0, user="r", job_class="guaranteed", gpus=1, physical_gpus=[0])
        ga = SimAgent(g.endpoint, "100", "guaranteed")
        o = client.register_job(sockdir, "200", uid=0, user="r", job_class="opportunistic", gpus=1)
        oa = SimAgent(o.endpoint, "200")
        try:
            ga.register()
            ga.report(100.0, 2 * GiB)
            oa.register()
            ga.report(100.0, 10 * GiB)  # new limits for 200, never acknowledged
            oa.recv("limits")
            r = next_report(hub, lambda r: any(x.noncompliant for x in r.preempt_requests), timeout_s=10)
            (req,) = [x for x in r.preempt_requests if x.noncompliant]
            assert req.job_id == "200" and "non-compliant" in req.reason and "acknowledge" in req.reason
            with pytest.raises(AssertionError):
                oa.recv("preempt", timeout_s=0.5)
        finally:
            ga.close()
            oa.close()


def test_a_checkpoint_notice_reaches_the_agents_that_can_checkpoint_only(env, caplog):
    conf, hub, side, sockdir = env
    caplog.set_level(logging.INFO)
    next_report(hub)
    o = client.register_job(sockdir, "301", uid=0, user="r", job_class="opportunistic", gpus=1, elastic_group="300")
    able = SimAgent(o.endpoint, "301", features=(p.FEATURE_CHECKPOINT,))
    old = SimAgent(o.endpoint, "301", rank=1)  # an agent from before the feature
    try:
        able.register()
        old.register()
        before = time.time()
        assert hub.send("n1", p.CheckpointNotice(job_id="301", at_s=12.0, reason="task 302 of elastic array 300 leaves"))
        ck = able.recv("checkpoint").body
        assert ck.seq == 1 and before + 12 <= ck.at_unix <= time.time() + 12
        assert ck.reason == "task 302 of elastic array 300 leaves"
        with pytest.raises(AssertionError):
            old.recv("checkpoint", timeout_s=0.3)
        able.send(p.CheckpointDone(seq=1, checkpoint_ms=40.0, late_ms=-300.0))
        wait_for(lambda: "checkpointed for request 1" in caplog.text, what="checkpoint_done logged")
        # The next one has the next seq.
        assert hub.send("n1", p.CheckpointNotice(job_id="301", at_s=0.0, reason="task 302 joined"))
        assert able.recv("checkpoint").body.seq == 2
        # A job that is no task of an elastic array is told so, by name; the sidecar goes on.
        client.register_job(sockdir, "310", uid=0, user="r", job_class="opportunistic", gpus=1)
        assert hub.send("n1", p.CheckpointNotice(job_id="310", at_s=0.0, reason="x"))
        wait_for(lambda: (hub.poll(0.05), "job 310 on node n1 is not a task of an elastic array" in caplog.text)[1],
                 what="bad_value logged")
        assert client.node_state(sockdir).node == "n1"
    finally:
        able.close()
        old.close()
