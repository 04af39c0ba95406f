"""The coordinator's SidecarHub over real ZeroMQ CURVE on 127.0.0.1: who gets in, what arrives, what is
refused and logged, and commands routed back to a node's sidecar."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest
import zmq

from slurm_antman import config as cfgmod
from slurm_antman import protocol as p
from slurm_antman import curve_keys as keys
from slurm_antman.coordinator.hub import HubError, SidecarHub

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_config(key_dir, port: int, nodes: str = "n[1-2]", **coordinator) -> cfgmod.AntmanConfig:
    return cfgmod.parse({
        "nodes": [{"name": nodes, "gpus": 1, "gpu_memory_mb": 16384}],
        "sidecar": {"heartbeat_s": 0.2, "telemetry": "emulated"},
        "coordinator": {"endpoint": f"tcp://127.0.0.1:{port}", "key_dir": str(key_dir),
                        "report_interval_s": 0.2, **coordinator},
    })


@pytest.fixture
def setup(tmp_path):
    kd = tmp_path / "keys"
    keys.init_keys(kd, ["n1", "n2"])
    conf = make_config(kd, free_port())
    hub = SidecarHub(conf)
    hub.start()
    yield conf, hub
    hub.close()


class Peer:
    """A DEALER on the uplink: with a node's keys, a foreign key pair, or no CURVE at all."""

    def __init__(self, conf, secret_file=None, keypair=None, server_key=None, plain=False):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, 2000)  # a refused DEALER has no pipe to send on
        if not plain:
            pub, sec = keypair or keys.load_keypair(secret_file)
            self.sock.curve_serverkey = server_key or keys.load_server_public(conf.coordinator.key_dir)
            self.sock.curve_publickey = pub
            self.sock.curve_secretkey = sec
        self.sock.connect(conf.coordinator.endpoint)

    def send(self, body) -> p.Message:
        msg = p.message(body)
        self.sock.send_multipart(p.encode(msg))
        return msg

    def recv(self, timeout_s: float = 5.0) -> p.Message | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return p.decode(self.sock.recv_multipart(), p.COORDINATOR_TO_SIDECAR)

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def node_peer(conf, node: str) -> Peer:
    return Peer(conf, conf.coordinator.secret_key_path(node))


def report(node: str = "n1", jobs=()) -> p.NodeReport:
    return p.NodeReport(
        node=node, telemetry="emulated",
        gpus=[p.ReportGpu(index=0, mem_total_bytes=16 << 30, mem_used_bytes=1 << 30, util=0.1, jobs=list(jobs))],
        jobs=[p.ReportJob(job_id=j, job_class="opportunistic", gpus=[0], mem_limit_bytes=None, mem_used_bytes=None,
                          compute_share=1.0, iteration_ms=None, last_checkpoint_unix=None) for j in jobs],
        preempt_requests=[])


def poll_until(hub, pred, timeout_s=5.0):
    got = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got += hub.poll(0.1)
        if pred(got):
            return got
    return got


def test_authorized_sidecar_report_arrives_and_is_acked(setup):
    conf, hub = setup
    peer = node_peer(conf, "n1")
    try:
        before = time.time()
        sent = peer.send(report("n1", jobs=["42"]))
        got = poll_until(hub, lambda g: g)
        assert len(got) == 1
        r = got[0]
        assert r.node == "n1" and r.body == sent.body and r.jobs[0].job_id == "42"
        assert before <= r.received_unix <= time.time()
        ack = peer.recv()
        assert ack.type == "node_report_ack" and ack.ref == sent.id
        assert ack.body.node == "n1" and ack.body.received_unix == pytest.approx(r.received_unix)
        assert hub.nodes_heard == ["n1"]
    finally:
        peer.close()


@pytest.mark.parametrize("kind", ["foreign_key", "no_curve", "wrong_server_key"])
def test_unauthenticated_peers_are_refused_and_logged(setup, kind, caplog):
    conf, hub = setup
    caplog.set_level(logging.WARNING)
    if kind == "foreign_key":
        peer = Peer(conf, keypair=zmq.curve_keypair())
    elif kind == "no_curve":
        peer = Peer(conf, plain=True)
    else:
        peer = Peer(conf, conf.coordinator.secret_key_path("n1"), server_key=zmq.curve_keypair()[0])
    good = node_peer(conf, "n2")
    try:
        try:
            peer.send(report("n1"))
        except zmq.Again:
            pass  # the handshake failed first, so there is no connection to queue on: refused all the same
        got = poll_until(hub, lambda g: False, timeout_s=1.5)
        assert got == [] and hub.nodes_heard == []
        assert hub.refusals >= 1
        assert "REFUSED" in caplog.text
        if kind == "foreign_key":
            assert "is not in" in caplog.text and "sidecars" in caplog.text
        # Nothing can be commanded to the refused peer, and an admitted one still gets in.
        assert hub.send("n1", p.JobClassUpdate(job_id="1", job_class="guaranteed")) is False
        good.send(report("n2"))
        assert [r.node for r in poll_until(hub, lambda g: g)] == ["n2"]
        assert hub.send("n2", p.JobClassUpdate(job_id="1", job_class="guaranteed")) is True
        assert good.recv().type == "node_report_ack"
        assert good.recv().type == "job_class_update"
        assert peer.recv(timeout_s=0.3) is None
    finally:
        peer.close()
        good.close()


def test_sidecar_cannot_report_for_another_node(setup, caplog):
    conf, hub = setup
    peer = node_peer(conf, "n1")
    try:
        sent = peer.send(report("n2"))
        assert poll_until(hub, lambda g: False, timeout_s=1.0) == []
        err = peer.recv()
        assert err.type == "error" and err.body.code == "forbidden" and err.ref == sent.id
        assert "cannot report for n2" in err.body.message
        assert "sent a report for node n2" in caplog.text
        assert hub.send("n2", p.JobClassUpdate(job_id="1", job_class="guaranteed")) is False
    finally:
        peer.close()


def test_malformed_frames_are_logged_answered_and_survived(setup, caplog):
    conf, hub = setup
    peer = node_peer(conf, "n1")
    limits = {"v": 1, "type": "limits", "id": "m3", "ts": 0, "ref": None,
              "body": {"seq": 1, "mem_limit_bytes": None, "compute_share": 1}}
    bad_report = json.loads(p.encode(p.message(report("n1")))[1])
    bad_report["body"]["gpus"][0]["util"] = "high"
    cases = [([b"x"], "bad_frames"), ([p.MARKER, b"{nope"], "bad_json"),
             ([p.MARKER, json.dumps(limits).encode()], "wrong_direction"),
             ([p.MARKER, json.dumps(bad_report).encode()], "bad_type"),
             ([p.MARKER, json.dumps({**limits, "v": 2}).encode()], "version_mismatch")]
    try:
        for frames, code in cases:
            peer.sock.send_multipart(frames)
            assert poll_until(hub, lambda g: False, timeout_s=0.3) == []
            err = peer.recv()
            assert err is not None and err.type == "error" and err.body.code == code, (frames, err)
        assert "bad message from node n1" in caplog.text
        peer.send(report("n1"))
        assert [r.node for r in poll_until(hub, lambda g: g)] == ["n1"]
    finally:
        peer.close()


def test_send_routes_to_the_reporting_node_only(setup):
    conf, hub = setup
    a, b = node_peer(conf, "n1"), node_peer(conf, "n2")
    try:
        assert hub.send("n1", p.PreemptNotice(job_id="5", grace_s=3, reason="r")) is False  # never reported
        a.send(report("n1"))
        b.send(report("n2"))
        assert sorted(r.node for r in poll_until(hub, lambda g: len(g) == 2)) == ["n1", "n2"]
        assert a.recv().type == b.recv().type == "node_report_ack"
        assert hub.send("n1", p.PreemptNotice(job_id="5", grace_s=3, reason="r")) is True
        msg = a.recv()
        assert msg.type == "preempt_notice" and (msg.body.job_id, msg.body.grace_s) == ("5", 3.0)
        assert b.recv(timeout_s=0.3) is None
        with pytest.raises(ValueError, match="not a coordinator-to-sidecar message"):
            hub.send("n1", p.Limits(seq=1, mem_limit_bytes=None, compute_share=1.0))
    finally:
        a.close()
        b.close()


def test_keys_added_and_removed_while_running(setup):
    conf, hub = setup
    kd = conf.coordinator.key_dir
    hub.key_rescan_s = 0.2
    keys.init_keys(kd, ["n1", "n2", "n3"])
    poll_until(hub, lambda g: False, timeout_s=0.5)  # the hub rescans the key directory meanwhile
    n3 = Peer(conf, f"{kd}/nodes/n3.key_secret")
    n2 = node_peer(conf, "n2")
    try:
        n3.send(report("n3"))
        assert [r.node for r in poll_until(hub, lambda g: g)] == ["n3"]
        # Revoking a key drops that node's messages even on its open connection.
        n2.send(report("n2"))
        assert [r.node for r in poll_until(hub, lambda g: g)] == ["n2"]
        (keys.sidecars_dir(kd) / "n2.key").unlink()
        poll_until(hub, lambda g: False, timeout_s=0.5)
        n2.send(report("n2"))
        assert poll_until(hub, lambda g: False, timeout_s=1.0) == []
    finally:
        n3.close()
        n2.close()


def test_hub_needs_keys(tmp_path):
    with pytest.raises(HubError, match="coordinator.key_dir is not set"):
        SidecarHub(cfgmod.parse({"nodes": [{"name": "n1", "gpus": 1}]}))
    with pytest.raises(keys.KeysError, match="antman keys init"):
        SidecarHub(make_config(tmp_path / "none", free_port())).start()


def test_bind_conflict_is_a_clear_error(setup):
    conf, hub = setup
    other = SidecarHub(conf)
    with pytest.raises(HubError, match="cannot bind the coordinator endpoint"):
        other.start()
