"""The coordinator's end of the sidecar uplink: a CURVE-server ROUTER that only admitted sidecars reach.

Admission is ZeroMQ's: the ZAP handler (pyzmq's ThreadAuthenticator, in its own thread) accepts a
client only if its public key is one of ``KEY_DIR/sidecars/NODE.key``, and stamps each of that
connection's messages with the node name as ZMQ ``User-Id``. The hub then checks that a report's
``node`` is that name, so an admitted sidecar cannot speak for another node.

Not thread-safe: ``start``, ``poll``, ``send`` and ``close`` belong to one thread (the daemon's loop).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Optional

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from slurm_antman import config as cfgmod
from slurm_antman import protocol as p
from slurm_antman.ratelimit import RateLimitedLog

from .. import curve_keys as keys
from ..errors import AntmanError

log = logging.getLogger("antman.coordinator.hub")

KEY_RESCAN_S = 2.0
ZAP_DOMAIN = "antman"
MAX_BATCH = 512


class HubError(AntmanError, RuntimeError):
    pass


@dataclass(frozen=True)
class HeardReport:
    """One decoded ``node_report`` from an authenticated sidecar, with the coordinator's receive time."""

    node: str
    received_unix: float
    body: p.NodeReport

    @property
    def telemetry(self) -> str:
        return self.body.telemetry

    @property
    def gpus(self) -> list[p.ReportGpu]:
        return self.body.gpus

    @property
    def jobs(self) -> list[p.ReportJob]:
        return self.body.jobs

    @property
    def preempt_requests(self) -> list[p.ReportPreemptRequest]:
        return self.body.preempt_requests

    @property
    def unhealthy(self) -> str:
        return self.body.unhealthy


class _KeyRing:
    """The admitted public keys; read by the ZAP thread, replaced whole by the hub's thread."""

    def __init__(self, key_dir: str):
        self.key_dir = key_dir
        self.nodes: dict[bytes, str] = {}
        self.admitted: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        self._rlog = RateLimitedLog(log)
        self._zap_rlog = RateLimitedLog(log)  # used only from the ZAP thread
        self._stamp: Optional[tuple] = None

    def rescan(self) -> bool:
        d = keys.sidecars_dir(self.key_dir)
        try:
            stamp = tuple(sorted((e.name, e.stat().st_mtime_ns, e.stat().st_size) for e in os.scandir(d)))
        except OSError:
            stamp = None
        if stamp == self._stamp and self._stamp is not None:
            return False
        found, problems = keys.scan_authorized(self.key_dir)
        for prob in problems:
            self._rlog.warning(f"keys:{prob}", "sidecar keys: %s", prob)
        with self._lock:
            changed = found != self.nodes
            self.nodes = found
            self.admitted = frozenset(found.values())
        self._stamp = stamp
        if changed:
            log.info("admitting %d sidecar key(s): %s", len(found), ", ".join(sorted(found.values())) or "none")
        return changed

    def node_of(self, z85_key: bytes) -> Optional[str]:
        with self._lock:
            return self.nodes.get(z85_key)

    # The ZAP thread's credentials callback (pyzmq's configure_curve_callback interface).
    def callback(self, domain: str, z85_key: bytes) -> bool:
        node = self.node_of(z85_key)
        if node is None:
            self._zap_rlog.warning(f"zap:{z85_key!r}", "REFUSED a sidecar connection: CURVE public key %s is not in %s",
                               z85_key.decode("ascii", "replace"), keys.sidecars_dir(self.key_dir))
            return False
        return True


class _Authenticator(ThreadAuthenticator):
    def __init__(self, context: zmq.Context, ring: _KeyRing):
        super().__init__(context, log=logging.getLogger("antman.coordinator.zap"))
        self._ring = ring

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._ring.node_of(z85.encode(client_public_key)) or ""


_HANDSHAKE_EVENTS = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication refused (ZAP status {value}: unknown sidecar key)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "CURVE handshake failed (protocol error {value}: a peer without CURVE "
                                         "or with the wrong coordinator key)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed (errno {value}: a peer without CURVE, or one that "
                                          "does not know the coordinator's public key)",
}


class SidecarHub:
    def __init__(self, config: cfgmod.AntmanConfig):
        c = config.coordinator
        if c.key_dir is None:
            raise HubError("coordinator.key_dir is not set in antman.yaml: the uplink needs CURVE keys "
                           "(set it and run `antman keys init --config antman.yaml`)")
        self.endpoint = c.endpoint
        self.key_dir = c.key_dir
        self._ring = _KeyRing(c.key_dir)
        self._ctx: Optional[zmq.Context] = None
        self._auth: Optional[_Authenticator] = None
        self._router: Optional[zmq.Socket] = None
        self._monitor: Optional[zmq.Socket] = None
        self._routes: dict[str, bytes] = {}
        self._last_rescan = 0.0
        self.key_rescan_s = KEY_RESCAN_S  # how soon keys added by `antman keys init` are admitted
        self._rlog = RateLimitedLog(log)
        self.refusals = 0  # handshakes refused since start (for tests and metrics)

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        public, secret = keys.load_server_keypair(self.key_dir)
        self._ring.rescan()
        self._ctx = zmq.Context()
        # The ZAP handler must be up before the bind, or libzmq admits every CURVE client.
        self._auth = _Authenticator(self._ctx, self._ring)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, self._ring)
        r = self._ctx.socket(zmq.ROUTER)
        r.setsockopt(zmq.LINGER, 0)
        r.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone sidecar is an error, not a silent drop
        r.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES + 4096)
        r.setsockopt(zmq.SNDHWM, 1000)
        r.curve_server = True
        r.curve_publickey = public
        r.curve_secretkey = secret
        r.zap_domain = ZAP_DOMAIN.encode()
        self._monitor = r.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                             | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        try:
            r.bind(self.endpoint)
        except zmq.ZMQError as e:
            r.close(0)
            self._router = r
            self.close()
            raise HubError(f"cannot bind the coordinator endpoint {self.endpoint}: {e}") from None
        self._router = r
        self._last_rescan = time.monotonic()
        log.info("coordinator uplink on %s (CURVE; sidecar keys from %s)", self.endpoint,
                 keys.sidecars_dir(self.key_dir))

    def close(self) -> None:
        if self._router is not None:
            try:
                self._router.disable_monitor()
            except zmq.ZMQError:
                pass
            self._router.close(0)
            self._router = None
        if self._monitor is not None:
            self._monitor.close(0)
            self._monitor = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._routes.clear()

    def __enter__(self) -> "SidecarHub":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def nodes_heard(self) -> list[str]:
        return sorted(self._routes)

    # --- receiving --------------------------------------------------------------------------

    def poll(self, timeout_s: float) -> list[HeardReport]:
        """Reports that arrive within ``timeout_s`` (returns as soon as there is at least one)."""
        if self._router is None:
            raise HubError("SidecarHub.poll() before start()")
        out: list[HeardReport] = []
        deadline = time.monotonic() + max(0.0, timeout_s)
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            mono = time.monotonic()
            if mono - self._last_rescan >= self.key_rescan_s:
                self.reload_keys()
                mono = self._last_rescan
            wait = max(0.0, min(deadline - mono, self._last_rescan + self.key_rescan_s - mono))
            ready = dict(poller.poll(wait * 1000))
            if self._monitor in ready:
                self._drain_monitor()
            if self._router in ready:
                self._drain(out)
            if out or time.monotonic() >= deadline:
                return out

    def reload_keys(self) -> bool:
        """Re-read ``KEY_DIR/sidecars`` now (poll() also does it every ``key_rescan_s``); whether it changed."""
        self._last_rescan = time.monotonic()
        return self._ring.rescan()

    def _drain_monitor(self) -> None:
        while True:
            try:
                ev = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            what = _HANDSHAKE_EVENTS.get(int(ev["event"]))
            if what is not None:
                self.refusals += 1
                self._rlog.warning(f"refused:{int(ev['event'])}", "REFUSED a connection on %s: %s",
                                   self.endpoint, what.format(value=int(ev["value"])))

    def _drain(self, out: list[HeardReport]) -> None:
        for _ in range(MAX_BATCH):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._on_frames(frames, out)
            except Exception as e:  # one bad message must not stop the coordinator
                log.exception("internal error handling an uplink message: %s", e)

    def _on_frames(self, frames: list[zmq.Frame], out: list[HeardReport]) -> None:
        identity = frames[0].bytes
        node = frames[-1].get("User-Id") if len(frames) > 1 else ""
        if not node or node not in self._ring.admitted:
            # Admitted at its handshake, but its key has since been removed from sidecars/.
            self._rlog.warning(f"revoked:{node}", "dropping a message from node %s's sidecar: its key is no "
                               "longer in %s", node or "?", keys.sidecars_dir(self.key_dir))
            return
        try:
            msg = p.decode([f.bytes for f in frames[1:]], p.SIDECAR_TO_COORDINATOR)
        except p.ProtocolError as e:
            self._rlog.warning(f"bad:{node}:{e.code.value}", "uplink: bad message from node %s (%s): %s",
                               node, e.code.value, e.message)
            self._reply(identity, p.error_message(e.code, e.message, e.ref))
            return
        b = msg.body
        if isinstance(b, p.NodeReport):
            if b.node != node:
                self._rlog.warning(f"forbidden:{node}", "uplink: node %s's sidecar sent a report for node %s; "
                                   "dropped", node, b.node)
                self._reply(identity, p.error_message(
                    p.ErrorCode.forbidden, f"this sidecar's key is node {node}'s; it cannot report for {b.node}",
                    msg.id))
                return
            now = time.time()
            if self._routes.get(node) != identity:
                log.info("node %s's sidecar connected", node)
            self._routes[node] = identity
            out.append(HeardReport(node, now, b))
            self._reply(identity, p.reply(msg, p.NodeReportAck(node=node, received_unix=now)))
        elif isinstance(b, p.Heartbeat):
            self._routes[node] = identity
            self._reply(identity, p.reply(msg, p.Heartbeat()))
        elif isinstance(b, p.Bye):
            if self._routes.get(node) == identity:
                del self._routes[node]
            log.info("node %s's sidecar said bye: %s", node, b.reason[:200])
        elif isinstance(b, p.Error):
            self._rlog.warning(f"err:{node}:{b.code}", "node %s's sidecar reports error %s: %s", node, b.code,
                               b.message[:500])

    # --- sending ----------------------------------------------------------------------------

    def _reply(self, identity: bytes, msg: p.Message) -> bool:
        try:
            self._router.send_multipart([identity, *p.encode(msg)], zmq.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError):  # EHOSTUNREACH (ROUTER_MANDATORY) or a full queue
            return False

    def send(self, node: str, body: p.Body) -> bool:
        """Send ``job_class_update`` / ``preempt_notice`` to a node's sidecar. False when that node has not
        reported since this hub started, or its connection is gone (it will report again, then resend)."""
        if self._router is None:
            raise HubError("SidecarHub.send() before start()")
        if body.TYPE not in p.COORDINATOR_TO_SIDECAR:
            raise ValueError(f"{body.TYPE!r} is not a coordinator-to-sidecar message; allowed: "
                             f"{', '.join(sorted(p.COORDINATOR_TO_SIDECAR))}")
        identity = self._routes.get(node)
        if identity is None:
            return False
        if not self._reply(identity, p.message(body)):
            log.warning("node %s's sidecar is not connected; %s not sent", node, body.TYPE)
            del self._routes[node]
            return False
        return True
