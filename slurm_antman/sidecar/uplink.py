"""The sidecar's end of the coordinator uplink: a CURVE-client DEALER that sends the node's reports and
receives the coordinator's commands.

It lives in the sidecar's loop thread (the daemon polls :attr:`Uplink.socket` with its other sockets);
this module owns the socket, the report timing and the connection bookkeeping, the daemon owns what a
report says and what a command does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import zmq

from slurm_antman import config as cfgmod
from slurm_antman import protocol as p
from slurm_antman import curve_keys as keys

from slurm_antman.ratelimit import RateLimitedLog

log = logging.getLogger("antman.sidecar.uplink")

# Unanswered report intervals after which the coordinator counts as unreachable (logged once).
SILENT_INTERVALS = 3


@dataclass(frozen=True)
class UplinkOptions:
    endpoint: str
    server_public_key: bytes
    public_key: bytes
    secret_key: bytes
    report_interval_s: float


def uplink_options(conf: cfgmod.AntmanConfig, node: str) -> Optional[UplinkOptions]:
    """The node's uplink settings, or None (with a warning saying why) when the sidecar must run without."""
    c = conf.coordinator
    secret_path = c.secret_key_path(node)
    if c.key_dir is None or secret_path is None:
        log.warning("no coordinator uplink: coordinator.key_dir is not set in antman.yaml "
                    "(this node's jobs get local limits, but no quotas, upgrades or requeues)")
        return None
    try:
        server = keys.load_server_public(c.key_dir)
        public, secret = keys.load_keypair(secret_path)
    except keys.KeysError as e:
        log.warning("no coordinator uplink for node %s: %s", node, e)
        return None
    return UplinkOptions(c.endpoint, server, public, secret, c.report_interval_s)


class Uplink:
    def __init__(self, context: zmq.Context, options: UplinkOptions, node: str):
        self.opt = options
        self.node = node
        self._ctx = context
        self.socket: Optional[zmq.Socket] = None
        self._next_report = 0.0
        self._last_ack: Optional[float] = None
        self._last_sent: Optional[float] = None
        self._reachable: Optional[bool] = None
        self._rlog = RateLimitedLog(log)
        self.reports_sent = 0
        self.acks = 0

    def open(self) -> None:
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        # Reports are complete states: while the coordinator is away, drop them rather than queue stale ones.
        s.setsockopt(zmq.IMMEDIATE, 1)
        s.setsockopt(zmq.SNDHWM, 4)
        s.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES + 4096)
        s.setsockopt(zmq.RECONNECT_IVL, 200)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        # ZMTP heartbeats find a coordinator host that vanished without closing the TCP connection.
        ivl = int(max(1.0, self.opt.report_interval_s) * 1000)
        s.setsockopt(zmq.HEARTBEAT_IVL, ivl)
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ivl)
        s.curve_serverkey = self.opt.server_public_key
        s.curve_publickey = self.opt.public_key
        s.curve_secretkey = self.opt.secret_key
        s.connect(self.opt.endpoint)
        self.socket = s
        log.info("node %s reports to the coordinator at %s every %g s", self.node, self.opt.endpoint,
                 self.opt.report_interval_s)

    def close(self) -> None:
        if self.socket is None:
            return
        self.send(p.Bye(reason="sidecar stopping"))
        self.socket.close(0)
        self.socket = None

    def report_due(self, mono: float) -> bool:
        return self.socket is not None and mono >= self._next_report

    def send(self, body: p.Body, ref: Optional[str] = None) -> bool:
        if self.socket is None:
            return False
        try:
            self.socket.send_multipart(p.encode(p.Message(body=body, ref=ref)), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False  # not connected (IMMEDIATE): the next report carries the same state
        except (p.ProtocolError, ValueError, zmq.ZMQError) as e:
            # E.g. a report whose sums a job's numbers pushed out of range: this report is lost, the
            # sidecar goes on (the next report is built afresh).
            self._rlog.warning(f"send:{body.TYPE}", "could not send %s to the coordinator: %s", body.TYPE, e)
            return False

    def send_report(self, report: p.NodeReport, mono: float) -> bool:
        self._next_report = mono + self.opt.report_interval_s
        sent = self.send(report)
        if sent:
            self.reports_sent += 1
            if self._last_sent is None:
                self._last_sent = mono
        self._check_reachable(mono)
        return sent

    def _check_reachable(self, mono: float) -> None:
        since = self._last_ack if self._last_ack is not None else self._last_sent
        silent = since is not None and mono - since > SILENT_INTERVALS * self.opt.report_interval_s
        if silent and self._reachable is not False:
            self._reachable = False
            log.warning("the coordinator at %s has not answered for %.0f s; reports continue (no quotas, "
                        "upgrades or requeues meanwhile)", self.opt.endpoint, mono - since)

    def receive(self, frames: list[bytes]) -> Optional[p.Message]:
        """The coordinator's message, or None after logging why it cannot be used."""
        try:
            msg = p.decode(frames, p.COORDINATOR_TO_SIDECAR)
        except p.ProtocolError as e:
            self._rlog.warning(f"bad:{e.code.value}", "bad message from the coordinator (%s): %s",
                               e.code.value, e.message)
            self.send(p.Error(code=e.code.value, message=e.message[:4096]), ref=e.ref)
            return None
        if isinstance(msg.body, p.NodeReportAck):
            self.acks += 1
            self._last_ack = time.monotonic()
            if self._reachable is not True:
                log.info("the coordinator at %s receives node %s's reports", self.opt.endpoint, self.node)
                self._reachable = True
        elif isinstance(msg.body, p.Error):
            self._rlog.warning(f"err:{msg.body.code}", "the coordinator refused a message (%s): %s",
                               msg.body.code, msg.body.message[:500])
        return msg

    def reply_error(self, code: p.ErrorCode, text: str, ref: Optional[str]) -> None:
        self._rlog.warning(f"cmd:{code.value}:{text[:120]}", "coordinator command refused (%s): %s", code.value, text)
        self.send(p.Error(code=code.value, message=text[:4096]), ref=ref)

