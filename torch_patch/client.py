"""The agent's side of the protocol (docs/protocol.md): a background thread that owns a DEALER.

One DEALER socket, used by two threads, one at a time under ``_sock_lock`` (ZeroMQ allows a socket to
move between threads with a full memory barrier; the lock is that barrier):

- the training thread, at each iteration boundary (:meth:`ProtocolClient.exchange`), takes the lock if
  it is free, reads what the sidecar sent and sends its acks and reports itself. A limit that arrives
  mid-iteration waits in ZeroMQ's queue, costs the job nothing, and is acknowledged at the boundary
  that applies it, without any thread switch: in CPython a hand-over to another thread waits for the
  GIL, up to the switch interval, while the training thread runs;
- the protocol thread serves whatever the training thread does not: heartbeats, re-registration,
  messages while the job is between iterations (loading data, evaluating, stuck), anything queued
  while the lock was taken. While boundaries keep coming (the next one expected within twice the last
  iteration), it sleeps on the wake-up pipe only and leaves the socket to the training thread; waking
  for each message would make it wait for the GIL and take it from the training thread. Otherwise it
  also polls the socket's notification fd (an OS fd, not the socket: safe while the other thread
  uses the socket).

The notification fd is edge-triggered: whoever used the socket reads ``EVENTS`` last and receives until
it shows no input (:meth:`ProtocolClient._service`), so the fd fires again for the next message. The
thread has its own zmq context, so a job that uses ZeroMQ itself is not affected.

Liveness follows the spec: a heartbeat when nothing else was sent for ``heartbeat_s``; after
``missed_heartbeats`` x ``heartbeat_s`` without hearing anything the sidecar is taken as gone: the
agent falls back (see :class:`Fallback`) and keeps re-registering every ``heartbeat_s`` until a
sidecar answers, whose ``registered`` then replaces the fallback.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import threading
import time
import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import zmq

from slurm_antman import protocol as P

log = logging.getLogger("torch_patch.client")

# Reports are batched to at most this many per second (the spec asks for about 20 at most).
REPORT_INTERVAL_S = 0.05
DEFAULT_HEARTBEAT_S = 1.0
MISSED_HEARTBEATS = 5
_LOOPBACK_HOSTS = ("127.0.0.1", "[::1]", "localhost")
# The protocol thread leaves the socket to the training thread for at least this long after a
# boundary. It is also how often that thread wakes (and takes the GIL for a moment) while the
# training thread is busy, and the longest a message waits when a loop stops at a boundary.
MIN_INLINE_S = 0.05



def drain_wakeups(fd: int) -> None:
    """Empty a non-blocking wake-up pipe: a thread blocked in poll() was woken through it, and every
    byte written since says the same thing."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass

class EndpointError(ValueError):
    pass


def check_endpoint(endpoint: str) -> str:
    """Only node-local transports: an IPC socket, or TCP on the loopback interface."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint
    if endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
        if host in _LOOPBACK_HOSTS:
            return endpoint
    raise EndpointError(
        f"{P.ENDPOINT_ENV}={endpoint!r}: the sidecar endpoint must be ipc://PATH or "
        "tcp://127.0.0.1:PORT / tcp://[::1]:PORT (node-local only)"
    )


@dataclass(frozen=True)
class LimitsUpdate:
    """Limits for the training thread to apply at its next boundary."""

    seq: int
    mem_limit_bytes: Optional[int]
    compute_share: float
    ref: Optional[str]  # id of the message to acknowledge; None: nothing to ack (fallback)
    reset: bool = False  # a registered from a (maybe new) sidecar: its seq replaces ours
    throttle: Optional[str] = None
    # the iteration during which it arrived: set by the training thread when it received it at a
    # boundary; otherwise the agent sets it when it takes the update over
    received_iteration: Optional[int] = None
    received_t: Optional[float] = None  # time.perf_counter() on arrival (CLOCK_MONOTONIC)
    # The idle-slot page (docs/protocol.md): None, None when the sidecar offers none (or this agent
    # did not name the "slots" feature).
    slot_page: Optional[str] = None
    slot_role: Optional[str] = None
    pin_bytes: int = 0  # host bytes it may keep pinned for a pause (limits.pin_bytes)


@dataclass
class PreemptNotice:
    """What a checkpoint hook (``torch_patch.on_preempt``) is called with.

    ``kind`` says why:

    - ``"preempt"``: the job is requeued at ``deadline_unix``;
    - ``"width"``: a width change (the elastic launcher, docs/elastic.md): ``width`` is the GPU list the
      job restarts on, ``grace_s`` is 0 and ``deadline_unix`` the moment the hook runs: every worker is
      stopped as soon as the hook returns;
    - ``"checkpoint"``: a task of the job's elastic array leaves or joins about now, which restarts every
      worker from the latest checkpoint; the job trains on after the hook (``deadline_unix``: the
      moment asked for).

    A hook saves a checkpoint the job can restart from; it must not assume the job stops after it."""

    deadline_unix: float
    grace_s: float
    reason: str
    width: Optional[tuple[int, ...]] = None
    kind: str = "preempt"


@dataclass(frozen=True)
class CheckpointRequest:
    """A ``checkpoint`` message for the training thread (only an agent that named the feature gets one)."""

    seq: int
    at_unix: float
    reason: str
    ref: Optional[str]  # the message's id: checkpoint_done refers to it


@dataclass(frozen=True)
class WidthRequest:
    """A ``width`` message for the training thread (only an agent that named the feature gets one)."""

    seq: int
    gpus: tuple[int, ...]
    reason: str
    ref: Optional[str]  # the message's id: width_done refers to it
    received_t: float   # time.perf_counter() on arrival


class ProtocolClient(threading.Thread):
    def __init__(
        self,
        endpoint: str,
        register: P.Register,
        on_limits: Callable[[LimitsUpdate], None],
        on_lost: Callable[[], None],
        on_preempt: Callable[[PreemptNotice], None],
        on_unmanaged: Callable[[str], None],
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        missed_heartbeats: int = MISSED_HEARTBEATS,
        on_pause: Optional[Callable[[int, str, float], None]] = None,
        on_resume: Optional[Callable[[int, float], None]] = None,
        on_width: Optional[Callable[[WidthRequest], None]] = None,
        slots: bool = False,
        on_checkpoint: Optional[Callable[[CheckpointRequest], None]] = None,
    ) -> None:
        super().__init__(name="antman-agent", daemon=True)
        self.endpoint = check_endpoint(endpoint)
        self._register_body = register
        self._on_limits = on_limits
        self._on_lost = on_lost
        self._on_preempt = on_preempt
        self._on_unmanaged = on_unmanaged
        self._on_pause = on_pause
        self._on_resume = on_resume
        self._on_width = on_width
        self._on_checkpoint = on_checkpoint
        if on_pause is not None and P.FEATURE_PAUSE not in register.features:
            register = dataclasses.replace(register, features=(*register.features, P.FEATURE_PAUSE))
        # An agent that pauses keeps pinned host memory within limits.pin_bytes (torch_patch.pause).
        if on_pause is not None and P.FEATURE_PIN not in register.features:
            register = dataclasses.replace(register, features=(*register.features, P.FEATURE_PIN))
        # Only the agent the elastic launcher's socket was handed to (local rank 0) names "width".
        if on_width is not None and P.FEATURE_WIDTH not in register.features:
            register = dataclasses.replace(register, features=(*register.features, P.FEATURE_WIDTH))
        if slots and P.FEATURE_SLOTS not in register.features:
            register = dataclasses.replace(register, features=(*register.features, P.FEATURE_SLOTS))
        if on_checkpoint is not None and P.FEATURE_CHECKPOINT not in register.features:
            register = dataclasses.replace(register, features=(*register.features, P.FEATURE_CHECKPOINT))
        self._register_body = register
        self.heartbeat_s = heartbeat_s
        self.missed_heartbeats = missed_heartbeats
        self._outbox: collections.deque[P.Body | tuple[P.Body, Optional[str]]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop_event = threading.Event()
        self._sock_lock = threading.Lock()
        self._sock: Optional[zmq.Socket] = None  # set while the thread runs; only used under _sock_lock
        # The training thread's look at the socket's notification fd (an OS poll, no ZeroMQ call), and
        # whether the socket was used since EVENTS last showed no input: only then can the fd's edge
        # have been consumed with a message still waiting (see exchange).
        self._fd_poll: Optional[select.poll] = None
        self._events_stale = True
        self._arrived_during: Optional[int] = None  # set while the training thread receives
        # monotonic time until which the training thread is expected back at a boundary
        self._inline_until = 0.0
        self.registered = threading.Event()  # set while a sidecar has answered our register
        self.job_class: Optional[str] = None
        self.connected = False
        self.unmanaged = False
        self.errors_received = 0
        self.malformed_received = 0
        self.registrations = 0
        self._last_heard = time.monotonic()
        self._last_sent = 0.0
        self._register_id: Optional[str] = None

    # --- training-thread side -------------------------------------------------------------

    def send(self, body: P.Body, ref: Optional[str] = None, wake: bool = True) -> None:
        self._outbox.append((body, ref))
        if wake:
            self.wake()

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the thread is already due to wake

    def exchange(self, arrived_during: int, next_within_s: Optional[float] = None) -> bool:
        """Training thread, at a boundary: send what is queued and handle what has arrived, on this
        thread, if the socket is free. False if the protocol thread has it (it was woken instead).

        ``arrived_during``: the iteration that just ended, the one during which whatever is waiting
        in the socket arrived. ``next_within_s``: when the next boundary is expected (the protocol
        thread stays off the socket until then)."""
        if next_within_s is not None:
            self._inline_until = time.monotonic() + min(max(next_within_s, MIN_INLINE_S), self.heartbeat_s / 2)
        fd_poll = self._fd_poll
        if not self._outbox and not self._events_stale and fd_poll is not None and not fd_poll.poll(0):
            # Nothing to send, and the notification fd has not fired since EVENTS last showed no input:
            # nothing arrived. An OS poll costs a few µs; taking the lock and asking ZeroMQ for EVENTS
            # cost 10-18 µs a boundary in a training loop (2026-11-26, antman bench control: about 1 %
            # of a 1.5 ms iteration).
            return True
        if not self._sock_lock.acquire(blocking=False):
            if self._outbox:
                self.wake()
            return False
        try:
            if self._sock is None:
                return False
            self._arrived_during = arrived_during
            try:
                self._service(self._sock)
            finally:
                self._arrived_during = None
            return True
        finally:
            self._sock_lock.release()

    def flush_queued(self, arrived_during: int) -> None:
        """:meth:`exchange` if anything is queued to send."""
        if self._outbox:
            self.exchange(arrived_during)

    def flush_now(self, arrived_during: int, timeout: float = 1.0) -> bool:
        """Training thread: hand everything queued to ZeroMQ before returning (a width change: the
        process is stopped right after). True when the queue is empty."""
        deadline = time.monotonic() + timeout
        while self._outbox:
            if self._sock is None or not self.is_alive():
                return False
            if not self.exchange(arrived_during):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.001)
        return True

    def stop(self, reason: str = "exit", timeout: float = 1.0) -> None:
        if not self.is_alive():
            return
        self._outbox.append((P.Bye(reason=reason), None))
        self._stop_event.set()
        self.wake()
        self.join(timeout)

    # --- thread -----------------------------------------------------------------------------

    def run(self) -> None:
        ctx = zmq.Context(1)
        sock = ctx.socket(zmq.DEALER)
        # No queueing towards a sidecar that is not there: a report sent into the void is dropped,
        # not delivered minutes late. Never block exit on unsent messages.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES + 64)
        poller = zmq.Poller()
        poller.register(sock.getsockopt(zmq.FD), zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        wake_only = zmq.Poller()
        wake_only.register(self._wake_r, zmq.POLLIN)
        try:
            sock.connect(self.endpoint)
            fd_poll = select.poll()
            fd_poll.register(sock.getsockopt(zmq.FD), select.POLLIN)
            with self._sock_lock:
                self._fd_poll = fd_poll
                self._sock = sock
                self._last_heard = time.monotonic()
                self._send_register(sock)
                self._service(sock)
            while not self._stop_event.is_set():
                try:
                    self._loop_once(sock, poller, wake_only)
                except Exception:
                    log.exception("slurm-antman agent: protocol loop error (continuing)")
                    time.sleep(0.05)
            with self._sock_lock:
                self._flush(sock)
        except Exception:
            log.exception("slurm-antman agent: protocol thread stopped")
        finally:
            with self._sock_lock:
                self._sock = None
                sock.close(0)
            ctx.term()
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _loop_once(self, sock: zmq.Socket, poller: zmq.Poller, wake_only: zmq.Poller) -> None:
        now = time.monotonic()
        timeout_s = max(0.0, min(self.heartbeat_s - (now - self._last_sent), self.heartbeat_s))
        inline_left = self._inline_until - now
        if inline_left > 0:
            events = dict(wake_only.poll(min(timeout_s, inline_left) * 1000.0))
            if not events and time.monotonic() < self._inline_until and \
                    time.monotonic() - self._last_sent < self.heartbeat_s:
                return  # a boundary came meanwhile: the socket stays the training thread's
        else:
            events = dict(poller.poll(timeout_s * 1000.0))
        if self._wake_r in events:
            drain_wakeups(self._wake_r)
        with self._sock_lock:
            self._service(sock)
            self._keepalive(sock)
            # Again: what the training thread queued while it found the lock taken goes out now,
            # not after another wake-up (which would wait for the GIL).
            self._service(sock)

    def _keepalive(self, sock: zmq.Socket) -> None:
        now = time.monotonic()
        silent = now - self._last_heard
        if silent > self.missed_heartbeats * self.heartbeat_s:
            if self.connected:
                self.connected = False
                self.registered.clear()
                log.warning("slurm-antman agent: no word from the sidecar for %.1f s; falling back", silent)
                self._on_lost()
        if now - self._last_sent >= self.heartbeat_s:
            if not self.connected and not self.unmanaged:
                self._send_register(sock)
            else:
                self._send(sock, P.Heartbeat())

    def _service(self, sock: zmq.Socket) -> None:
        """Send the queue, then receive until EVENTS shows no input (the fd's edge is re-armed)."""
        self._flush(sock)
        self._receive(sock)

    def _receive(self, sock: zmq.Socket) -> None:
        # Bounded, so a flood from a broken sidecar cannot pin the training thread; what is left
        # re-arms nothing, so the protocol thread is woken to take it.
        self._events_stale = True  # until EVENTS shows no input
        for _ in range(100):
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._events_stale = False
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self._last_heard = time.monotonic()
            self._handle(sock, frames)
        self.wake()

    def _flush(self, sock: zmq.Socket) -> None:
        while self._outbox:
            body, ref = self._outbox.popleft()
            if self.unmanaged and not isinstance(body, P.Bye):
                continue
            if isinstance(body, (P.Report, P.Ack)) and not self.connected:
                continue  # nobody to tell; the next registration starts afresh
            self._send(sock, body, ref)

    def _send(self, sock: zmq.Socket, body: P.Body, ref: Optional[str] = None) -> Optional[str]:
        msg = P.Message(body=body, ref=ref)
        self._events_stale = True  # a send processes ZeroMQ's commands: it may take the fd's edge
        try:
            sock.send_multipart(P.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            return None  # no sidecar connected (IMMEDIATE) or it is not reading: drop
        self._last_sent = time.monotonic()
        return msg.id

    def _send_register(self, sock: zmq.Socket) -> None:
        self.registrations += 1
        self._register_id = self._send(sock, self._register_body)
        if self._register_id is None:
            self._last_sent = time.monotonic()  # retry after heartbeat_s, not in a busy loop

    def _handle(self, sock: zmq.Socket, frames: list) -> None:
        try:
            msg = P.decode(frames, accept=P.SIDECAR_TO_AGENT)
        except P.ProtocolError as e:
            self.malformed_received += 1
            log.warning("slurm-antman agent: ignoring a malformed message from the sidecar: %s", e)
            self._send(sock, P.Error(code=e.code.value, message=e.message[:4096]), e.ref)
            if e.code == P.ErrorCode.version_mismatch:
                self._go_unmanaged(e.message)
            return
        body = msg.body
        if isinstance(body, P.Registered):
            self._registered(body, msg)
        elif isinstance(body, P.Limits):
            if not self.connected:
                return  # limits from a sidecar that has not (re)registered us: wait for registered
            self._on_limits(LimitsUpdate(body.seq, body.mem_limit_bytes, body.compute_share, msg.id,
                                         received_iteration=self._arrived_during,
                                         received_t=time.perf_counter(),
                                         slot_page=body.slot_page, slot_role=body.slot_role, pin_bytes=body.pin_bytes))
        elif isinstance(body, P.Preempt):
            self._on_preempt(PreemptNotice(body.deadline_unix, body.grace_s, body.reason))
        elif isinstance(body, (P.Pause, P.Resume)):
            handler = self._on_pause if isinstance(body, P.Pause) else self._on_resume
            if handler is None:  # never registered "pause": a sidecar that sends it anyway gets told
                self._send(sock, P.Error(code=P.ErrorCode.unknown_type.value,
                                         message=f"this agent does not support {body.TYPE!r}"), msg.id)
            elif isinstance(body, P.Pause):
                self._on_pause(body.seq, body.reason, time.perf_counter())
            else:
                self._on_resume(body.seq, time.perf_counter())
        elif isinstance(body, P.Width):
            if self._on_width is None:  # never registered "width" (not local rank 0 of a launcher's job)
                self._send(sock, P.Error(code=P.ErrorCode.unknown_type.value,
                                         message=f"this agent does not support {body.TYPE!r}"), msg.id)
            else:
                self._on_width(WidthRequest(body.seq, tuple(body.gpus), body.reason, msg.id, time.perf_counter()))
        elif isinstance(body, P.Checkpoint):
            if self._on_checkpoint is None:
                self._send(sock, P.Error(code=P.ErrorCode.unknown_type.value,
                                         message=f"this agent does not support {body.TYPE!r}"), msg.id)
            else:
                self._on_checkpoint(CheckpointRequest(body.seq, body.at_unix, body.reason, msg.id))
        elif isinstance(body, P.Heartbeat):
            pass
        elif isinstance(body, P.Error):
            self.errors_received += 1
            log.warning("slurm-antman agent: sidecar error %s: %s", body.code, body.message)
            if body.code == P.ErrorCode.version_mismatch.value:
                self._go_unmanaged(body.message)
            elif body.code == P.ErrorCode.not_registered.value:
                self.connected = False
                self.registered.clear()
                self._send_register(sock)
        elif isinstance(body, P.Bye):
            log.warning("slurm-antman agent: sidecar said bye (%s)", body.reason)
            if self.connected:
                self.connected = False
                self.registered.clear()
                self._on_lost()
            # Keep re-registering: a restarted sidecar serves the same endpoint.
            self._last_heard = 0.0

    def _registered(self, body: P.Registered, msg: P.Message) -> None:
        self.heartbeat_s = body.heartbeat_s
        self.job_class = body.job_class
        self.connected = True
        self.registered.set()
        self._on_limits(LimitsUpdate(body.seq, body.mem_limit_bytes, body.compute_share, msg.id,
                                     reset=True, throttle=body.throttle,
                                     received_iteration=self._arrived_during,
                                     slot_page=body.slot_page, slot_role=body.slot_role))

    def _go_unmanaged(self, why: str) -> None:
        if not self.unmanaged:
            log.error("slurm-antman agent: protocol version mismatch (%s); the job runs unmanaged", why)
        self.unmanaged = True
        self.connected = False
        self.registered.clear()
        self._on_unmanaged(why)


def default_register(job_id: str, job_class: str, device: str, agent_version: str, torch_version: str) -> P.Register:
    env = os.environ

    def env_int(names: tuple[str, ...], default: int) -> int:
        for n in names:
            try:
                return int(env[n])
            except (KeyError, ValueError):
                continue
        return default

    return P.Register(
        job_id=job_id,
        pid=os.getpid(),
        rank=max(0, env_int(("RANK", "SLURM_PROCID"), 0)),
        local_rank=max(0, env_int(("LOCAL_RANK", "SLURM_LOCALID"), 0)),
        world_size=max(1, env_int(("WORLD_SIZE", "SLURM_NTASKS"), 1)),
        hostname=socket.gethostname()[:255],
        agent_version=agent_version[:64],
        torch_version=torch_version[:64],
        device=device,
        job_class=job_class if job_class in P.AGENT_CLASSES else "none",
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
    )
