"""The sidecar's one thread: a ZeroMQ poller over the root-only control socket, one ROUTER per job
and the coordinator's uplink, ticking between messages; and the control socket's requests.

Single-threaded on purpose: every zmq socket lives in the loop's thread, so no locks are needed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import zmq

from slurm_antman import protocol as p
from slurm_antman.ratelimit import RateLimitedLog

from . import peers
from .records import RegisteredJob
from .uplink import Uplink

log = logging.getLogger("antman.sidecar")

MAX_BATCH = 256  # messages drained from one socket before looking at the others
# Queued messages per peer, each way: a peer that floods is dropped from, not buffered for.
ROUTER_HWM = 1000


def _peer_address(frame: zmq.Frame) -> Optional[str]:
    try:
        return frame.get("Peer-Address")
    except zmq.ZMQError:
        return None


def bound_router(sock: zmq.Socket) -> None:
    """A ROUTER a job (or any local user) can reach: no message over the protocol's limit is even
    read (libzmq disconnects the peer), and queues are bounded both ways."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES + 4096)
    sock.setsockopt(zmq.SNDHWM, ROUTER_HWM)
    sock.setsockopt(zmq.RCVHWM, ROUTER_HWM)


class SocketLoop:
    """Mixed into ``daemon.Sidecar``, which makes this state; the handlers it calls live in the other mixins."""

    _control: Optional[zmq.Socket]
    _poller: zmq.Poller
    _sock_job: dict[zmq.Socket, RegisteredJob]
    _uplink: Optional[Uplink]
    _stop: threading.Event
    _dirty: bool
    _rlog: RateLimitedLog
    _peer: Optional[peers.Peer]

    def serve_forever(self) -> None:
        if not self.started.is_set():
            self.start()
        next_tick = time.monotonic()
        try:
            while not self._stop.is_set():
                timeout_ms = max(0.0, min(next_tick - time.monotonic(), 0.1)) * 1000
                for sock, _ in self._poller.poll(timeout_ms):
                    self._drain(sock)
                if self._reload_requested.is_set():
                    self._reload()
                mono = time.monotonic()
                if mono >= next_tick:
                    next_tick = mono + self.opt.tick_s
                    self._tick(time.time(), mono)
                elif self._dirty:
                    self._run_policy(time.time())
                self._report_to_coordinator(mono)
        finally:
            self.close()

    def _drain(self, sock: zmq.Socket) -> None:
        for _ in range(MAX_BATCH):
            try:
                if sock in self._sock_job:
                    parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    self._peer = peers.from_peer_address(_peer_address(parts[0]))
                    frames = [f.bytes for f in parts]
                else:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if sock is self._control:
                    self._on_control(frames)
                elif self._uplink is not None and sock is self._uplink.socket:
                    self._on_coordinator(frames)
                else:
                    job = self._sock_job.get(sock)
                    if job is not None:
                        self._on_agent(job, frames)
            except Exception as e:  # a bug must cost one message, not the node's sidecar
                log.exception("internal error handling a message: %s", e)

    @staticmethod
    def _split(frames: list[bytes]) -> tuple[bytes, list[bytes], list[bytes]]:
        """(identity, delimiter frames a REQ peer needs echoed, protocol frames)."""
        identity, rest = frames[0], frames[1:]
        if rest and rest[0] == b"":
            return identity, [b""], rest[1:]
        return identity, [], rest

    def _reply_raw(self, sock: zmq.Socket, route: list[bytes], msg: p.Message) -> None:
        try:
            sock.send_multipart(route + p.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the peer is gone or not reading; dropping is right for a best-effort reply
        except (p.ProtocolError, ValueError, zmq.ZMQError) as e:
            # A value a job's reports made unencodable, or a socket gone under us: that message is
            # lost, never the sidecar (every other job on the node depends on it).
            self._rlog.warning(f"send:{msg.body.TYPE}", "could not send %s: %s", msg.body.TYPE, e)

    def _protocol_error(self, where: str, sock: zmq.Socket, route: list[bytes], e: p.ProtocolError) -> None:
        self._rlog.warning(f"{where}:{e.code.value}", "%s: bad message (%s): %s", where, e.code.value, e.message)
        self._reply_raw(sock, route, p.error_message(e.code, e.message, e.ref))

    def _on_control(self, frames: list[bytes]) -> None:
        identity, delim, rest = self._split(frames)
        route = [identity, *delim]
        try:
            msg = p.decode(rest, p.CONTROL_REQUESTS)
        except p.ProtocolError as e:
            self._protocol_error("control", self._control, route, e)
            return
        try:
            body = self._control_request(msg)
        except p.ProtocolError as e:
            e.ref = msg.id
            self._protocol_error("control", self._control, route, e)
            return
        except Exception as e:
            log.exception("control request %s failed", msg.type)
            body = p.Error(code="internal", message=f"{msg.type} failed: {e}")
        self._reply_raw(self._control, route, p.reply(msg, body))

    def _control_request(self, msg: p.Message) -> p.Body:
        b = msg.body
        if isinstance(b, p.JobRegister):
            return self._register_job(b)
        if isinstance(b, p.JobRetire):
            return p.JobRetireReply(job_id=b.job_id, known=self._retire_job(b.job_id))
        if isinstance(b, p.NodeState):
            return self._node_state()
        return p.Heartbeat()
