"""Elastic width on the real sidecar (docs/elastic.md), over real ZeroMQ IPC sockets with
agents played by plain DEALERs: a guaranteed job's claim sheds one GPU of an elastic job through its
launcher's agent instead of a pause or a requeue; the GPU counts as given back when the job's process
on it has gone, and one kept past the grace time gets the job requeued; the job grows back after the
hold."""

from __future__ import annotations

import time

import pytest

from slurm_antman import config as cfgmod
from slurm_antman import protocol as p
from slurm_antman.clients import sidecar_control as client
from slurm_antman.policy.node.core import GiB

from test_sidecar_daemon import Running, SimAgent, job_of, make_config, sockdir, wait_for  # noqa: F401


class Worker(SimAgent):
    """One torchrun worker's agent: local rank and CUDA_VISIBLE_DEVICES as the launcher sets them."""

    def __init__(self, endpoint: str, job_id: str, local_rank: int, cvd: str, launcher: bool = False):
        super().__init__(endpoint, job_id, rank=local_rank,
                         features=(p.FEATURE_PAUSE, *((p.FEATURE_WIDTH,) if launcher else ())))
        self.cvd = cvd
        self.world_size = len(cvd.split(","))

    def register(self) -> p.Message:
        req = self.send(p.Register(job_id=self.job_id, pid=self.pid, rank=self.rank, local_rank=self.rank,
                                   world_size=self.world_size, hostname="n1", agent_version="sim", torch_version="none",
                                   device="cuda", job_class="opportunistic", cuda_visible_devices=self.cvd,
                                   features=self.features))
        reply = self.recv("registered")
        assert reply.ref == req.id
        return reply


def _recv_alive(agent: SimAgent, want: str, timeout_s: float) -> p.Message:
    """``agent.recv`` while it sends heartbeats, as a live agent does (the sidecar drops a silent one)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        agent.send(p.Heartbeat())
        try:
            return agent.recv(want, timeout_s=0.1)
        except AssertionError:
            continue
    raise AssertionError(f"no {want!r} within {timeout_s} s")


def _elastic_on_both(sockdir: str) -> tuple[p.JobRegisterReply, Worker, Worker]:
    o = client.register_job(sockdir, "200", uid=0, user="r", job_class="opportunistic", gpus=2, elastic_min=1)
    assert sorted(o.gpus) == [0, 1]
    w0 = Worker(o.endpoint, "200", 0, "0,1", launcher=True)
    w1 = Worker(o.endpoint, "200", 1, "0,1")
    for w in (w0, w1):
        w.register()
        w.report(100.0, 2 * GiB)
    return o, w0, w1


def _claim_gpu1(sockdir: str) -> SimAgent:
    g = client.register_job(sockdir, "100", uid=0, user="r", job_class="guaranteed", gpus=1, physical_gpus=[1])
    ga = SimAgent(g.endpoint, "100", "guaranteed")
    ga.register()
    ga.report(100.0, 15 * GiB)  # 16 GiB GPU, 512 MiB headroom: under the 1 GiB an opportunistic job needs
    return ga


def test_a_claim_sheds_one_gpu_through_the_launcher_and_the_job_grows_back_after_the_hold(sockdir):
    r = Running(sockdir, make_config(gpus=2, elastic_hold_s=1.0))
    agents: list[SimAgent] = []
    try:
        _, w0, w1 = _elastic_on_both(sockdir)
        agents += [w0, w1]
        agents.append(_claim_gpu1(sockdir))
        width = w0.recv("width").body
        assert (width.seq, width.gpus) == (1, [0]) and "GPU(s) 1 needed" in width.reason
        assert "width" not in w1.drain_types()             # only the launcher's agent is told
        st = client.node_state(sockdir)
        assert job_of(st, "200").gpus == [0] and not job_of(st, "200").paused and st.preemptions == []
        assert st.gpus[1].jobs == ["100"]                   # GPU 1 is the guaranteed job's at once
        w0.send(p.WidthDone(seq=1, checkpoint_ms=40.0))
        assert r.sidecar.width_return_s == []               # rank 1 still runs on GPU 1
        # The launcher stops the workers and starts one on GPU 0; it registers as the new rank 0.
        w1.send(p.Bye(reason="exit"))
        w0.send(p.Bye(reason="exit"))
        wait_for(lambda: len(r.sidecar.width_return_s) == 1, what="GPU 1 given back")
        new0 = Worker(p.ipc(r.sidecar.dir.agent_path("200")), "200", 0, "0", launcher=True)
        agents.append(new0)
        new0.register()
        assert "width" not in new0.drain_types()            # it runs at the width the sidecar counts
        # A launcher's agent that comes back at the old width (its workers restarted before the change
        # reached them) is told the width again.
        stale = Worker(p.ipc(r.sidecar.dir.agent_path("200")), "200", 0, "0,1", launcher=True)
        agents.append(stale)
        stale.register()
        again = stale.recv("width").body
        assert (again.seq, again.gpus) == (1, [0])
        stale.send(p.Bye(reason="exit"))
        v = r.sidecar.metrics_view()
        assert (v.width_shrinks, v.width_grows, v.width_unreturned, v.pauses) == (1, 0, 0, 0)
        # The guaranteed job leaves: GPU 1 is idle, and once the hold has passed the job grows onto it.
        client.retire_job(sockdir, "100")
        t0 = time.monotonic()
        grow = _recv_alive(new0, "width", 5.0).body
        assert (grow.seq, grow.gpus) == (2, [0, 1]) and "GPU 1 is idle" in grow.reason
        assert job_of(client.node_state(sockdir), "200").gpus == [0, 1]
        assert r.sidecar.metrics_view().width_grows == 1
        assert time.monotonic() - t0 < 5
    finally:
        for a in agents:
            a.close()
        r.stop()


def test_a_shed_gpu_still_used_after_the_grace_time_gets_the_job_requeued(sockdir):
    conf = make_config(gpus=2).model_dump(mode="json")
    conf["grace_time_s"] = 1
    r = Running(sockdir, cfgmod.parse(conf))
    agents: list[SimAgent] = []
    try:
        _, w0, w1 = _elastic_on_both(sockdir)
        agents += [w0, w1]
        agents.append(_claim_gpu1(sockdir))
        assert w0.recv("width").body.gpus == [0]
        end = time.monotonic() + 1.6
        while time.monotonic() < end:                       # rank 1 ignores it and stays on GPU 1
            for w in (w0, w1):
                w.send(p.Heartbeat())
            time.sleep(0.1)
        pre = w1.recv("preempt", timeout_s=3).body
        assert "told to give up GPU 1" in pre.reason and "grace time (1 s)" in pre.reason
        assert r.sidecar.metrics_view().width_unreturned == 1 and r.sidecar.noncompliant_total == 1
        assert any(q.job_id == "200" for q in client.node_state(sockdir).preemptions)
    finally:
        for a in agents:
            a.close()
        r.stop()


def test_without_the_launchers_agent_the_claim_pauses_the_job_as_before(sockdir):
    r = Running(sockdir, make_config(gpus=2))
    agents: list[SimAgent] = []
    try:
        o = client.register_job(sockdir, "200", uid=0, user="r", job_class="opportunistic", gpus=2, elastic_min=1)
        w0 = Worker(o.endpoint, "200", 0, "0,1")            # a plain torchrun: no launcher, no "width"
        agents.append(w0)
        w0.register()
        w0.report(100.0, 2 * GiB)
        agents.append(_claim_gpu1(sockdir))
        assert w0.recv("pause").body.seq == 1
        assert r.sidecar.metrics_view().width_shrinks == 0
    finally:
        for a in agents:
            a.close()
        r.stop()


@pytest.mark.parametrize("kw, field", [
    (dict(job_class="guaranteed", gpus=1, physical_gpus=[0], elastic_min=1), "must be null for guaranteed"),
    (dict(job_class="opportunistic", gpus=2, elastic_min=3), "above the job's width"),
])
def test_an_elastic_range_the_sidecar_cannot_honour_is_refused_by_name(sockdir, kw, field):
    r = Running(sockdir, make_config(gpus=2))
    try:
        with pytest.raises(client.SidecarError, match=f"elastic_min.*{field}"):
            client.register_job(sockdir, "300", uid=0, user="r", **kw)
        assert client.node_state(sockdir).jobs == []
    finally:
        r.stop()


def test_a_restarted_sidecar_keeps_the_jobs_width_and_range(sockdir):
    r = Running(sockdir, make_config(gpus=2))
    agents: list[SimAgent] = []
    try:
        _, w0, w1 = _elastic_on_both(sockdir)
        agents += [w0, w1]
        agents.append(_claim_gpu1(sockdir))
        assert w0.recv("width").body.gpus == [0]
    finally:
        for a in agents:
            a.close()
        r.stop()
    r2 = Running(sockdir, make_config(gpus=2))
    try:
        job = r2.sidecar.jobs["200"]
        assert (job.gpus, job.elastic_gpus, job.elastic_min, job.width_seq) == ([0], [0, 1], 1, 1)
    finally:
        r2.stop()
