"""What the Prolog, the Epilog and the CLI call to talk to a node's sidecar over its control socket.

Each call opens a fresh REQ socket with a timeout, so a dead sidecar costs one timeout and never
leaves a socket stuck in REQ's send/receive lockstep.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import zmq

from slurm_antman import protocol as p
from slurm_antman.errors import AntmanError

DEFAULT_TIMEOUT_S = 5.0


class SidecarUnreachable(AntmanError, RuntimeError):
    """No sidecar answered on the control socket in time."""


class SidecarError(AntmanError, RuntimeError):
    """The sidecar answered with a protocol ``error``."""

    def __init__(self, code: str, message: str):
        self.code = code
        self.message = message
        super().__init__(f"sidecar refused the request ({code}): {message}")


def request(socket_dir: str, body: p.Body, timeout_s: float = DEFAULT_TIMEOUT_S,
            context: Optional[zmq.Context] = None) -> p.Body:
    path = p.control_path(socket_dir)
    if not os.path.exists(path):
        raise SidecarUnreachable(f"no sidecar control socket at {path} (is `antman sidecar` running "
                                 f"with --socket-dir {socket_dir}?)")
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    try:
        ms = max(1, int(timeout_s * 1000))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, ms)
        sock.setsockopt(zmq.RCVTIMEO, ms)
        sock.connect(p.ipc(path))
        msg = p.message(body)
        try:
            sock.send_multipart(p.encode(msg))
            frames = sock.recv_multipart()
        except zmq.Again:
            raise SidecarUnreachable(f"the sidecar at {path} did not answer {body.TYPE} within {timeout_s:g} s") from None
    finally:
        sock.close(0)
    answer = p.decode(frames, p.CONTROL_REPLIES)
    if answer.ref != msg.id:
        raise p.ProtocolError(p.ErrorCode.bad_envelope, f"reply refers to {answer.ref!r}, not to request {msg.id!r}")
    if isinstance(answer.body, p.Error):
        raise SidecarError(answer.body.code, answer.body.message)
    return answer.body


def _expect(reply: p.Body, cls: type) -> p.Body:
    if not isinstance(reply, cls):
        raise p.ProtocolError(p.ErrorCode.wrong_direction, f"expected {cls.TYPE}, the sidecar sent {reply.TYPE}")
    return reply


def register_job(socket_dir: str, job_id: str, uid: int, user: str, job_class: str, gpus: int,
                 physical_gpus: Optional[Sequence[int]] = None, gid: Optional[int] = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, account: Optional[str] = None,
                 may_wait: bool = False, elastic_min: Optional[int] = None,
                 elastic_group: Optional[str] = None) -> p.JobRegisterReply:
    """``may_wait``: the caller requeues the job when the answer is placement ``wait`` (no GPU met
    the opportunistic rules); without it the sidecar never answers ``wait``. ``elastic_min``: an
    elastic job's narrowest width (docs/elastic.md); None for any other job. ``elastic_group``: the
    array's job id for a task of an elastic array across nodes; None for any other job."""
    body = p.JobRegister(job_id=str(job_id), uid=uid, gid=gid, user=user, job_class=job_class, gpus=gpus,
                         physical_gpus=list(physical_gpus) if physical_gpus is not None else None,
                         account=account or None, may_wait=may_wait, elastic_min=elastic_min,
                         elastic_group=elastic_group)
    return _expect(request(socket_dir, body, timeout_s), p.JobRegisterReply)


def retire_job(socket_dir: str, job_id: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether the sidecar knew the job (retiring twice is fine: the Epilog may run again)."""
    return _expect(request(socket_dir, p.JobRetire(job_id=str(job_id)), timeout_s), p.JobRetireReply).known


def node_state(socket_dir: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> p.NodeStateReply:
    return _expect(request(socket_dir, p.NodeState(), timeout_s), p.NodeStateReply)


def ping(socket_dir: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    request(socket_dir, p.Heartbeat(), timeout_s)
