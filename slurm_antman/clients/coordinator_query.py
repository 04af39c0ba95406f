"""The `antman` CLI's end of the coordinator's query channel (coordinator/query.py has the other end).

Every request gets a fresh munge credential from this host's munged, made for the calling process and
carrying the request (``protocol.query_payload``): the coordinator learns who asks from munged alone.
A fresh DEALER per request, with a deadline, so a coordinator that does not answer costs one timeout
and leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from slurm_antman import munge
from slurm_antman import protocol as p
from slurm_antman.errors import AntmanError

DEFAULT_TIMEOUT_S = 3.0


class QueryError(AntmanError):
    """The coordinator could not be asked, or its answer could not be used; the message is one line."""


class CoordinatorUnreachable(QueryError):
    pass


class QueryRefused(QueryError):
    """The coordinator answered with a protocol ``error`` (``code``: its ErrorCode value)."""

    def __init__(self, code: str, message: str, address: str):
        self.code = code
        self.message = message
        super().__init__(f"the coordinator at {address} refused the request ({code}): {message}")


def request(address: str, body: p.Body, timeout_s: float = DEFAULT_TIMEOUT_S,
            encode: Callable[[bytes], str] = munge.encode, deadline: Optional[float] = None) -> p.Body:
    """Send the query ``body`` (its ``credential`` is filled in here) and return the reply's body.
    ``deadline`` (monotonic): when several requests share ``timeout_s``."""
    msg_id = p.new_id()
    try:
        credential = encode(p.query_payload(msg_id, body))
    except munge.MungeError as e:
        raise QueryError(f"cannot make a munge credential on this host to ask the coordinator: {e}") from None
    msg = p.Message(body=dataclasses.replace(body, credential=credential), id=msg_id)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES + 4096)
    # A refused connection (no coordinator, or none serving queries) is known at once: say so rather
    # than wait out the deadline, since views ask on every call (a plain cluster has no coordinator).
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    connected = False
    try:
        try:
            sock.connect(address)
            sock.send_multipart(p.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise CoordinatorUnreachable(f"cannot reach the coordinator at {address}: {e}") from None
        if deadline is None:
            deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            ready = dict(poller.poll(left * 1000)) if left > 0 else {}
            if not ready:
                raise CoordinatorUnreachable(f"the coordinator does not answer at {address} (waited {timeout_s:g} s)")
            if monitor in ready:
                event = recv_monitor_message(monitor)["event"]
                connected = connected or event == zmq.EVENT_CONNECTED
                if event == zmq.EVENT_CONNECT_RETRIED and not connected:
                    raise CoordinatorUnreachable(f"the coordinator does not answer at {address} (connection refused)")
            if sock not in ready:
                continue
            frames = sock.recv_multipart()
            try:
                got = p.decode(frames, p.QUERY_REPLIES)
            except p.ProtocolError as e:
                if e.code is p.ErrorCode.version_mismatch:
                    raise QueryError(f"the coordinator at {address} speaks antman protocol v{e.peer_version}, "
                                     f"this antman v{p.PROTOCOL_VERSION}: install the same slurm-antman on this "
                                     "host as on the coordinator's") from None
                raise QueryError(f"the coordinator at {address} sent an answer this antman cannot read "
                                 f"({e.code.value}: {e.message}); is it another slurm-antman version?") from None
            if got.ref != msg_id:
                continue  # not ours (cannot happen on a fresh socket; harmless to skip)
            if isinstance(got.body, p.Error):
                raise QueryRefused(got.body.code, got.body.message, address)
            return got.body
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


def _paged(address: str, make: Callable[[int], p.Body], items: str, timeout_s: float) -> tuple[p.QueryCaller, list]:
    deadline = time.monotonic() + timeout_s
    out: list = []
    page, pages = 0, 1
    caller = None
    while page < pages:
        reply = request(address, make(page), timeout_s, deadline=deadline)
        caller, pages = reply.caller, reply.pages
        out.extend(getattr(reply, items))
        page += 1
    assert caller is not None
    return caller, out


def jobs(address: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[p.QueryCaller, list[p.QueryJob]]:
    """Every job the sidecars report, one row per job and node, details only where the caller may see them."""
    return _paged(address, lambda page: p.QueryJobs(credential="", page=page), "jobs", timeout_s)


def nodes(address: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[p.QueryCaller, list[p.QueryNode]]:
    return _paged(address, lambda page: p.QueryNodes(credential="", page=page), "nodes", timeout_s)


def explain(address: str, job_id: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> p.QueryExplainReply:
    return request(address, p.QueryExplain(credential="", job_id=job_id), timeout_s)


def address_of(cfg: Optional[object]) -> Optional[str]:
    """The query endpoint antman.yaml names, or None (no antman.yaml, or the endpoint is off)."""
    if cfg is None:
        return None
    return cfg.coordinator.query_address()  # type: ignore[attr-defined]
