"""The node sidecar daemon: one ZeroMQ poller loop serving the root-only control socket and one
ROUTER per job, sampling telemetry on a tick, running the local policy on every report and tick,
and sending agents their limits when they change.

Single-threaded on purpose: every zmq socket lives in the loop's thread, so no locks are needed;
``stop()`` is the only method another thread may call.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import zmq

import slurm_antman
from slurm_antman import protocol as p

from slurm_antman.policy.node import compliance
from . import driver_caps, health, peers
from .endpoints import SocketDirError, SocketDir
from slurm_antman.policy.node.core import (
    UNLIMITED, GpuInfo, JobInfo, JobLimits, PolicyParams, PolicyState, PreemptRequest, Snapshot, decide,
)
from slurm_antman.policy.node.placement import GpuLoad, choose_gpus, util_measured
from slurm_antman.ratelimit import RateLimitedLog
from .telemetry import (
    GpuSample, ProcessSample, ReportedLoad, Telemetry, UtilizationWindow,
)
from .uplink import Uplink, UplinkOptions

log = logging.getLogger("antman.sidecar")

AGENT_TIMEOUT_HEARTBEATS = 5
PAUSE_TIMES_KEPT = 256
HEALTH_CHECK_S = 2.0  # statvfs of the state directories at most this often
# Placement memory: a requeued job is back within Slurm's BeginTime (120 s) plus its queue wait; a
# day covers that on a busy cluster and bounds what a sidecar keeps.
AVOID_TTL_S = 86400.0
AVOID_MAX_JOBS = 4096
MAX_BATCH = 256  # messages drained from one socket before looking at the others


def _peer_address(frame: zmq.Frame) -> Optional[str]:
    try:
        return frame.get("Peer-Address")
    except zmq.ZMQError:
        return None


# An agent is one training process; a few per GPU covers every launcher seen (one per rank).
MAX_AGENTS_PER_GPU = 8
# Queued messages per peer, each way: a peer that floods is dropped from, not buffered for.
ROUTER_HWM = 1000


def _bound_router(sock: zmq.Socket) -> None:
    """A ROUTER a job (or any local user) can reach: no message over the protocol's limit is even
    read (libzmq disconnects the peer), and queues are bounded both ways."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES + 4096)
    sock.setsockopt(zmq.SNDHWM, ROUTER_HWM)
    sock.setsockopt(zmq.RCVHWM, ROUTER_HWM)


@dataclass(frozen=True)
class SidecarOptions:
    node: str
    socket_dir: str
    heartbeat_s: float = 1.0
    grace_s: float = 30.0
    slots_per_gpu: int = 2
    utilization_threshold: float = 0.8
    utilization_window_s: float = 10.0
    tick_s: float = 1.0
    opportunistic_throttle: str = "launch"
    params: PolicyParams = PolicyParams()
    uplink: Optional[UplinkOptions] = None  # None: no coordinator; the sidecar notifies preemptions itself
    enforce: bool = True  # False: observe only (sidecar.enforce)
    no_room_wait: bool = True  # opportunistic.no_room == "wait"
    hooks_state_dir: Optional[str] = None  # where the Prolog writes this node's env files (state_dir/NODE)
    compliance: compliance.ComplianceParams = compliance.ComplianceParams()


@dataclass
class AgentConnection:
    identity: bytes
    reg: p.Register
    gpu: Optional[int]
    last_seen: float
    last_sent: float
    report: Optional[p.Report] = None
    report_unix: Optional[float] = None
    acked_seq: int = 0


@dataclass
class RegisteredJob:
    job_id: str
    job_class: str
    uid: int
    gid: Optional[int]
    user: str
    gpus: list[int]
    placement: str
    note: str
    registered_unix: float
    socket: Optional[zmq.Socket] = None
    agents: dict[bytes, AgentConnection] = field(default_factory=dict)
    limits: JobLimits = UNLIMITED
    seq: int = 0
    preempt: Optional[PreemptRequest] = None
    account: str = ""
    limits_sent_unix: Optional[float] = None  # when the limits of ``seq`` were sent
    first_report_unix: Optional[float] = None  # its agents' first report since this sidecar started
    # Pause in place: the pause in force (its seq), when it was sent, when its agents acked it.
    pause_seq: int = 0
    paused: bool = False
    pause_sent_mono: Optional[float] = None
    paused_unix: Optional[float] = None
    resume_sent_mono: Optional[float] = None

    def record(self) -> dict:
        return {"job_id": self.job_id, "job_class": self.job_class, "uid": self.uid, "gid": self.gid,
                "user": self.user, "gpus": self.gpus, "placement": self.placement, "note": self.note,
                "registered_unix": self.registered_unix, "account": self.account}


class Sidecar:
    def __init__(self, options: SidecarOptions, telemetry: Telemetry):
        self.opt = options
        self.telemetry = telemetry
        self.dir = SocketDir(options.socket_dir)
        self.jobs: dict[str, RegisteredJob] = {}
        self.policy_state = PolicyState()
        # Placement memory from the coordinator's preempt_notice: job -> (GPUs to keep it off, until
        # when). Used when Slurm requeues the job onto this node again; lost on a restart (a
        # preference, never a ban), bounded so a flood of notices cannot grow it without end.
        self.avoid: dict[str, tuple[frozenset[int], float]] = {}
        self.progress: dict[str, float] = {}  # opportunistic job -> progress, as the last decision measured
        self.util = UtilizationWindow(options.utilization_window_s)
        self.gpu_samples: list[GpuSample] = []
        self.proc_samples: list[ProcessSample] = []
        self._ctx = zmq.Context()
        self._control: Optional[zmq.Socket] = None
        self._poller = zmq.Poller()
        self._sock_job: dict[zmq.Socket, RegisteredJob] = {}
        self._stop = threading.Event()
        self._dirty = False
        self._rlog = RateLimitedLog(log)
        self._peer: Optional[peers.Peer] = None  # credentials of the sender of the message in hand
        self._uplink: Optional[Uplink] = None
        self._report_now = False
        self.started = threading.Event()
        self.started_unix = time.time()  # the utilisation window holds nothing from before this
        # Set by whoever serves metrics (the CLI); filled from the loop thread once per tick.
        self.metrics = None
        self.placement_waits = 0  # opportunistic jobs answered "wait" (no GPU met the rules)
        self.state_write_errors = 0
        self.pauses_total = 0
        self.pause_seconds_total = 0.0
        self.pause_bytes_moved_total = 0
        self.pause_ack_ms: list[float] = []  # sidecar's pause sent -> agent's ack, the latest ones
        self.resume_ack_ms: list[float] = []  # resume sent -> agent's resumed (training again)
        self.unhealthy = ""  # why no opportunistic job may start here now (health.node_problem); "" = healthy
        # Driver-level memory caps (MPS v3 memory partitioning), set in start() where the node has them.
        self.caps_support = driver_caps.Support("emulated telemetry: no NVIDIA driver")
        self.caps: Optional[driver_caps.MemoryCaps] = None
        self.cap_errors = 0
        self.gpu_pids_by_job: dict[str, list[int]] = {}
        self._health_checked = 0.0
        # slurm_antman.policy.node.compliance: (job, condition) -> since when; jobs asked to be requeued for it; a count.
        self.compliance_since: dict[tuple[str, str], float] = {}
        self.noncompliant: dict[str, PreemptRequest] = {}
        self.noncompliant_total = 0
        # Job -> GPU memory of each of its processes NVML shows, mapped through Slurm's cgroups once per
        # telemetry sample (not per message: it reads /proc).
        self.gpu_procs_by_job: dict[str, list[int]] = {}
        # SIGHUP: the handler only sets the flag; the loop calls ``reloader`` (which returns the new
        # options, or None to keep the old) so the options change between messages, never mid-message.
        self.reloader: Optional[Callable[[SidecarOptions], Optional[SidecarOptions]]] = None
        self._reload_requested = threading.Event()

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self.started_unix = time.time()
        self.dir.prepare()
        self._control = self._ctx.socket(zmq.ROUTER)
        _bound_router(self._control)
        self._control.bind(p.ipc(self.dir.control_path))
        self.dir.secure_control()
        self._poller.register(self._control, zmq.POLLIN)
        if self.opt.uplink is not None:
            self._uplink = Uplink(self._ctx, self.opt.uplink, self.opt.node)
            self._uplink.open()
            self._poller.register(self._uplink.socket, zmq.POLLIN)
        self._sample(time.time())
        for rec in self.dir.saved_jobs():
            try:
                self._restore(rec)
            except (KeyError, TypeError, ValueError, SocketDirError, zmq.ZMQError) as e:
                log.warning("could not restore saved job %r: %s", rec.get("job_id"), e)
        if self.jobs:
            log.info("restored %d job(s) from %s: %s", len(self.jobs), self.dir.root, ", ".join(sorted(self.jobs)))
        if self.telemetry.kind == "nvml":
            nvml = getattr(self.telemetry, "nvml", None)
            self.caps_support = driver_caps.detect(nvml)
            if self.caps_support.available and self.opt.enforce:
                self.caps = driver_caps.MemoryCaps(nvml, self.caps_support)
        log.info("enforcement on %s: %s; %s", self.opt.node,
                 "agent limits and compliance checks" if self.opt.enforce else "none (sidecar.enforce: false)",
                 self.caps_support.describe())
        self._run_policy(time.time())
        self._publish_metrics()
        log.info("sidecar for node %s serving %s (telemetry: %s, %d GPU(s))", self.opt.node,
                 self.dir.control_path, self.telemetry.kind, self.telemetry.gpu_count())
        self.started.set()

    def stop(self) -> None:
        self._stop.set()

    def request_reload(self) -> None:
        """Safe from a signal handler or another thread."""
        self._reload_requested.set()

    def _reload(self) -> None:
        self._reload_requested.clear()
        if self.reloader is None:
            return
        new = self.reloader(self.opt)
        if new is None:
            return
        self.opt = new
        if new.utilization_window_s != self.util.window_s:
            self.util.window_s = new.utilization_window_s
        self._dirty = True  # new policy knobs apply to every job right away
        log.info("configuration reloaded; %d job(s) kept: %s", len(self.jobs), ", ".join(sorted(self.jobs)) or "none")

    def _publish_metrics(self) -> None:
        if self.metrics is not None:
            from slurm_antman.metrics import sidecar_view

            self.metrics.publish(sidecar_view(self))

    def close(self) -> None:
        """Close sockets but keep the job directories and records: a restarted sidecar rebinds them."""
        for job in self.jobs.values():
            for a in job.agents.values():
                self._send(job.socket, a, p.Bye(reason="sidecar stopping"))
            if job.socket is not None:
                job.socket.close(0)
        if self._uplink is not None:
            self._uplink.close()
        if self._control is not None:
            self._control.close(0)
        self._ctx.term()
        self.dir.release()
        self.telemetry.close()

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
                if self._uplink is not None and (self._report_now or self._uplink.report_due(mono)):
                    self._report_now = False
                    self._uplink.send_report(self._node_report(), time.monotonic())
        finally:
            self.close()

    # --- receiving --------------------------------------------------------------------------

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

    def _on_agent(self, job: RegisteredJob, frames: list[bytes]) -> None:
        identity, delim, rest = self._split(frames)
        route = [identity, *delim]
        try:
            msg = p.decode(rest, p.AGENT_TO_SIDECAR)
        except p.ProtocolError as e:
            self._protocol_error(f"job {job.job_id} agent", job.socket, route, e)
            return
        mono = time.monotonic()
        b = msg.body
        agent = job.agents.get(identity)
        if agent is not None:
            agent.last_seen = mono
        if isinstance(b, p.Register):
            self._register_agent(job, identity, msg, mono)
        elif isinstance(b, p.Bye):
            if job.agents.pop(identity, None) is not None:
                log.info("job %s: agent pid %d left (%s)", job.job_id, agent.reg.pid, b.reason[:200])
                self._dirty = True
        elif isinstance(b, p.Error):
            self._rlog.warning(f"agent-error:{b.code}", "job %s: agent reports error %s: %s",
                               job.job_id, b.code, b.message[:500])
        elif agent is None:
            self._protocol_error(f"job {job.job_id} agent", job.socket, route, p.ProtocolError(
                p.ErrorCode.not_registered, f"send 'register' before {msg.type!r} (the sidecar may have restarted)",
                msg.id))
        elif isinstance(b, p.Report):
            agent.report = b
            agent.report_unix = time.time()
            if job.first_report_unix is None:
                job.first_report_unix = agent.report_unix
            self._dirty = True
        elif isinstance(b, p.Ack):
            agent.acked_seq = max(agent.acked_seq, b.seq)
        elif isinstance(b, p.Paused):
            if b.seq == job.pause_seq and job.paused and job.paused_unix is None:
                job.paused_unix = time.time()
                self.pause_bytes_moved_total += b.bytes_moved
                if job.pause_sent_mono is not None:
                    self.pause_ack_ms.append((time.monotonic() - job.pause_sent_mono) * 1000.0)
                    del self.pause_ack_ms[:-PAUSE_TIMES_KEPT]
                log.info("job %s: paused: %d MiB moved to host memory, %d MiB of GPU memory freed (%.1f ms in the agent)",
                         job.job_id, b.bytes_moved >> 20, b.bytes_freed >> 20, b.pause_ms)
            self._dirty = True
        elif isinstance(b, p.Resumed):
            if b.seq == job.pause_seq and job.resume_sent_mono is not None:
                self.resume_ack_ms.append((time.monotonic() - job.resume_sent_mono) * 1000.0)
                del self.resume_ack_ms[:-PAUSE_TIMES_KEPT]
                job.resume_sent_mono = None
            log.info("job %s: resumed (%.1f ms in the agent)", job.job_id, b.resume_ms)

    def _register_agent(self, job: RegisteredJob, identity: bytes, msg: p.Message, mono: float) -> None:
        reg: p.Register = msg.body
        route = [identity]
        if reg.job_id != job.job_id:
            self._protocol_error(f"job {job.job_id} agent", job.socket, route, p.ProtocolError(
                p.ErrorCode.forbidden, f"this endpoint serves job {job.job_id}, not job {reg.job_id}", msg.id))
            return
        host_pid, refused = peers.check(self._peer, reg.pid, job.job_id, job.uid)
        if refused:
            self._protocol_error(f"job {job.job_id} agent", job.socket, route, p.ProtocolError(
                p.ErrorCode.forbidden, refused, msg.id))
            return
        if host_pid != reg.pid:
            reg = replace(reg, pid=host_pid)  # NVML and /proc know the process by this one
        if reg.job_class not in ("none", job.job_class):
            log.warning("job %s: agent believes class %s, sidecar has %s; the sidecar's class applies",
                        job.job_id, reg.job_class, job.job_class)
        cap = MAX_AGENTS_PER_GPU * max(1, len(job.gpus))
        if identity not in job.agents and len(job.agents) >= cap:
            # Each agent costs the sidecar memory and a share of every tick; a job may not flood it.
            self._protocol_error(f"job {job.job_id} agent", job.socket, route, p.ProtocolError(
                p.ErrorCode.forbidden, f"job {job.job_id} already has {len(job.agents)} agents registered, the most "
                f"a job with {len(job.gpus)} GPU(s) on this node may have ({MAX_AGENTS_PER_GPU} per GPU)", msg.id))
            return
        gpu = job.gpus[reg.local_rank % len(job.gpus)] if job.gpus else None
        # `registered` carries the job's current limits, so they count as acknowledged.
        agent = AgentConnection(identity, reg, gpu, last_seen=mono, last_sent=mono, acked_seq=job.seq)
        job.agents[identity] = agent
        log.info("job %s: agent pid %d rank %d registered (%s, torch %s)", job.job_id, reg.pid, reg.rank,
                 reg.device, reg.torch_version)
        throttle = "off" if job.job_class == "guaranteed" else self.opt.opportunistic_throttle
        self._send(job.socket, agent, p.Registered(
            job_id=job.job_id, job_class=job.job_class, seq=job.seq, mem_limit_bytes=job.limits.mem_limit_bytes,
            compute_share=job.limits.compute_share, heartbeat_s=self.opt.heartbeat_s, throttle=throttle), ref=msg.id)
        if job.preempt is not None:
            self._send_preempt(job, agent)
        elif job.paused and p.FEATURE_PAUSE in reg.features:
            # An agent that joins a paused job (a new rank, a restarted process) pauses with it.
            self._send(job.socket, agent, p.Pause(seq=job.pause_seq, reason="the job is paused in place"))

    # --- sending ----------------------------------------------------------------------------

    def _send(self, sock: Optional[zmq.Socket], agent: AgentConnection, body: p.Body, ref: Optional[str] = None) -> None:
        if sock is None:
            return
        agent.last_sent = time.monotonic()
        self._reply_raw(sock, [agent.identity], p.Message(body=body, ref=ref))

    def _send_preempt(self, job: RegisteredJob, agent: AgentConnection) -> None:
        assert job.preempt is not None
        grace = max(0.0, job.preempt.deadline_unix - job.preempt.requested_unix)
        self._send(job.socket, agent, p.Preempt(deadline_unix=job.preempt.deadline_unix,
                                                grace_s=grace, reason=job.preempt.reason))

    # --- jobs -------------------------------------------------------------------------------

    def _gpu_loads(self) -> list[GpuLoad]:
        loads = []
        now = time.time()
        for s in self.gpu_samples:
            on = [j for j in self.jobs.values() if s.index in j.gpus]
            loads.append(GpuLoad(s.index, s.memory_total_bytes, s.memory_used_bytes, self.util.average(s.index),
                                 sum(j.job_class == "guaranteed" for j in on),
                                 sum(j.job_class == "opportunistic" for j in on),
                                 self._util_measured(on, now)))
        return loads

    def _util_measured(self, on: list[RegisteredJob], now: float) -> bool:
        return all(util_measured(now, self.util.window_s, self.opt.compliance.grace_s,
                                 max(j.registered_unix, self.started_unix), j.first_report_unix)
                   for j in on if j.job_class == "guaranteed")

    def _register_job(self, b: p.JobRegister) -> p.JobRegisterReply:
        n = self.telemetry.gpu_count()
        old = self.jobs.get(b.job_id)
        if old is not None and (old.job_class, old.uid, old.gid) == (b.job_class, b.uid, b.gid) and (
                b.physical_gpus is None or sorted(b.physical_gpus) == sorted(old.gpus)):
            # A retried Prolog (or one re-registering after a sidecar restart): same answer.
            return self._register_reply(old)
        if b.job_class == "guaranteed":
            if b.physical_gpus is None:
                raise p.ProtocolError(p.ErrorCode.bad_value,
                                      "job_register.physical_gpus is required for guaranteed jobs (the GPUs Slurm bound)")
            if len(set(b.physical_gpus)) != len(b.physical_gpus) or len(b.physical_gpus) != b.gpus:
                raise p.ProtocolError(p.ErrorCode.bad_value, f"job_register.physical_gpus {b.physical_gpus} must "
                                      f"be {b.gpus} distinct GPU indices (job_register.gpus)")
            bad = [i for i in b.physical_gpus if i >= n]
            if bad:
                raise p.ProtocolError(p.ErrorCode.bad_value, f"job_register.physical_gpus: {bad} out of range; "
                                      f"node {self.opt.node} has GPUs 0-{n - 1}")
            gpus, placement, note = list(b.physical_gpus), "requested", ""
        else:
            if b.physical_gpus is not None:
                raise p.ProtocolError(p.ErrorCode.bad_value, "job_register.physical_gpus must be null for "
                                      "opportunistic jobs: the sidecar chooses their GPUs")
            if old is not None:
                self._retire_job(old.job_id)
            self._sample(time.time())  # place on fresh numbers, not the last tick's
            avoid, until = self.avoid.pop(b.job_id, (frozenset(), 0.0))
            self._check_health(time.monotonic(), force=True)  # fresh: the Prolog may have just failed to write
            if self.unhealthy and self.opt.no_room_wait and b.may_wait:
                self.placement_waits += 1
                note = f"node {self.opt.node} takes no new opportunistic job: {self.unhealthy}"
                log.info("job %s: %s; the Prolog requeues it", b.job_id, note)
                return p.JobRegisterReply(job_id=b.job_id, gpus=[], endpoint="", placement="wait", note=note[:4096])
            choice = choose_gpus(self._gpu_loads(), b.gpus, self.opt.slots_per_gpu,
                                 self.opt.utilization_threshold, self.opt.utilization_window_s,
                                 self.opt.params.target_slowdown, self.opt.params.min_progress,
                                 avoid if until > time.time() else (),
                                 wait_without_room=self.opt.no_room_wait and b.may_wait)
            gpus, placement, note = choice.gpus, choice.placement, choice.note
            if placement == "fallback":
                log.warning("job %s: fallback placement on GPU(s) %s: %s", b.job_id, gpus, note)
            elif placement == "wait":
                # Not registered: the Prolog requeues the job. Its placement memory outlives the refusal.
                if avoid:
                    self.avoid[b.job_id] = (avoid, until)
                self.placement_waits += 1
                log.info("job %s: no room for %d GPU(s); the Prolog requeues it: %s", b.job_id, b.gpus, note)
                return p.JobRegisterReply(job_id=b.job_id, gpus=[], endpoint="", placement="wait", note=note[:4096])
        if old is not None and b.job_id in self.jobs:
            self._retire_job(old.job_id)
        job = RegisteredJob(b.job_id, b.job_class, b.uid, b.gid, b.user, gpus, placement, note, time.time(),
                  account=b.account or "")
        self._open_job(job)
        self._save(job)
        log.info("job %s (%s, uid %d) registered on GPU(s) %s [%s]", job.job_id, job.job_class, job.uid, gpus, placement)
        self._run_policy(time.time())
        return self._register_reply(job)

    def _save(self, job: RegisteredJob) -> None:
        """Record the job for a restarted sidecar. A full or read-only state directory costs only
        that (a restart would not find the job): the job itself is served and limited as before."""
        try:
            self.dir.save_job(job.job_id, job.record())
        except OSError as e:
            self.state_write_errors += 1
            self._rlog.warning("state-write", "job %s: cannot record it in %s (%s); it is served, but a restarted "
                               "sidecar will not find it", job.job_id, self.dir.root, e)

    def _register_reply(self, job: RegisteredJob) -> p.JobRegisterReply:
        return p.JobRegisterReply(job_id=job.job_id, gpus=list(job.gpus), endpoint=p.ipc(self.dir.agent_path(job.job_id)),
                                  placement=job.placement, note=job.note)

    def _open_job(self, job: RegisteredJob) -> None:
        path = self.dir.make_job_dir(job.job_id, job.uid, job.gid)
        sock = self._ctx.socket(zmq.ROUTER)
        _bound_router(sock)
        try:
            sock.bind(p.ipc(path))
            self.dir.secure_agent_socket(job.job_id, job.uid, job.gid)
        except (zmq.ZMQError, OSError, SocketDirError) as e:
            sock.close(0)
            self.dir.remove_job(job.job_id)
            raise SocketDirError(f"cannot bind job {job.job_id}'s endpoint {path}: {e}") from None
        job.socket = sock
        self._sock_job[sock] = job
        self._poller.register(sock, zmq.POLLIN)
        self.jobs[job.job_id] = job

    def _restore(self, rec: dict) -> None:
        job = RegisteredJob(str(rec["job_id"]), rec["job_class"], int(rec["uid"]), rec.get("gid"), str(rec["user"]),
                  [int(g) for g in rec["gpus"]], rec["placement"], rec["note"], float(rec["registered_unix"]),
                  account=str(rec.get("account") or ""))
        if job.job_class not in p.JOB_CLASSES:
            raise ValueError(f"bad class {job.job_class!r}")
        self._open_job(job)

    def _retire_job(self, job_id: str) -> bool:
        job = self.jobs.pop(job_id, None)
        if job is None:
            self.dir.remove_job(job_id)  # an Epilog after a crash may find only the directory
            return False
        if job.socket is not None:
            for a in job.agents.values():
                self._send(job.socket, a, p.Bye(reason="job retired"))
            self._poller.unregister(job.socket)
            self._sock_job.pop(job.socket, None)
            job.socket.close(0)
        self.dir.remove_job(job_id)
        self._lift_caps(job_id)
        log.info("job %s retired", job_id)
        self._run_policy(time.time())
        return True

    # --- telemetry, policy, ticks -----------------------------------------------------------

    def _agent_mem(self, a: AgentConnection, proc_mem: dict[int, int]) -> int:
        reported = a.report.mem_reserved_bytes if a.report else 0
        return max(reported, proc_mem.get(a.reg.pid, 0))

    def _sample(self, now: float) -> None:
        fresh_after = time.monotonic() - AGENT_TIMEOUT_HEARTBEATS * self.opt.heartbeat_s
        mem: dict[int, int] = {}
        busy: dict[int, float] = {}
        for job in self.jobs.values():
            for a in job.agents.values():
                if a.gpu is None or a.report is None or a.last_seen < fresh_after:
                    continue
                mem[a.gpu] = mem.get(a.gpu, 0) + a.report.mem_reserved_bytes
                if a.report.iteration_ms > 0:
                    busy[a.gpu] = busy.get(a.gpu, 0.0) + min(1.0, a.report.busy_ms / a.report.iteration_ms)
        reported = {g: ReportedLoad(mem.get(g, 0), busy.get(g, 0.0)) for g in set(mem) | set(busy)}
        try:
            self.gpu_samples, self.proc_samples = self.telemetry.sample(reported)
        except Exception as e:  # a driver hiccup must not stop the node's sidecar
            self._rlog.warning("telemetry", "telemetry sample failed: %s", e)
            return
        procs: dict[str, list[int]] = {}
        pids: dict[str, list[int]] = {}
        for s in self.proc_samples:
            for job_id in peers.slurm_jobs_of(s.pid) or ():
                procs.setdefault(job_id, []).append(s.memory_bytes or 0)
                pids.setdefault(job_id, []).append(s.pid)
        self.gpu_procs_by_job = procs
        self.gpu_pids_by_job = pids
        for s in self.gpu_samples:
            self.util.add(now, s.index, s.utilization)

    def _snapshot(self) -> Snapshot:
        proc_mem = {s.pid: s.memory_bytes for s in self.proc_samples if s.memory_bytes is not None}
        managed: dict[int, int] = {}
        jobs = []
        for job in self.jobs.values():
            demand, iteration, ms = 0, None, None
            for a in job.agents.values():
                used = self._agent_mem(a, proc_mem)
                if a.gpu is not None:
                    managed[a.gpu] = managed.get(a.gpu, 0) + used
                if a.report is not None:
                    r = a.report
                    demand = max(demand, used, r.mem_peak_bytes)
                    iteration = r.iteration if iteration is None else max(iteration, r.iteration)
                    ms = r.iteration_ms if ms is None else max(ms, r.iteration_ms)
                else:
                    demand = max(demand, used)
            can_pause = bool(job.agents) and all(p.FEATURE_PAUSE in a.reg.features for a in job.agents.values())
            jobs.append(JobInfo(job.job_id, job.job_class, tuple(job.gpus), job.registered_unix, demand, iteration, ms,
                                can_pause=can_pause))
        gpus = tuple(GpuInfo(s.index, s.memory_total_bytes,
                             max(0, s.memory_used_bytes - managed.get(s.index, 0)) if self.telemetry.kind == "nvml" else 0)
                     for s in self.gpu_samples)
        return Snapshot(gpus, tuple(jobs))

    def _run_policy(self, now: float) -> None:
        self._dirty = False
        decision = decide(self._snapshot(), self.policy_state, self.opt.params, now)
        self.policy_state = decision.state
        self.progress = dict(decision.progress)
        if not self.opt.enforce:
            # Observe only: the policy still runs (its state and the slowdowns it measures are
            # reported), but nothing it decides reaches a job.
            decision = replace(decision, limits={j: UNLIMITED for j in decision.limits}, new_preemptions=())
        for req in decision.new_preemptions:
            job = self.jobs.get(req.job_id)
            if job is None:
                continue
            if self._uplink is not None:
                # The coordinator chooses the victim cluster-wide and requeues it; it answers with a
                # preempt_notice, which is what the agent gets.
                log.warning("job %s: preemption REQUEST to the coordinator: %s", job.job_id, req.reason)
                self._report_now = True
                continue
            job.preempt = req
            log.warning("job %s: PREEMPTION requested (deadline in %.0f s): %s", job.job_id,
                        req.deadline_unix - now, req.reason)
            for a in job.agents.values():
                self._send_preempt(job, a)
        for rec in decision.new_pauses:
            job = self.jobs.get(rec.job_id)
            if job is not None:
                self._pause(job, rec.reason)
        for job_id in decision.resumes:
            job = self.jobs.get(job_id)
            if job is not None:
                self._resume(job)
        for job_id, lim in decision.limits.items():
            job = self.jobs.get(job_id)
            if job is None or lim == job.limits:
                continue
            job.seq += 1
            job.limits = lim
            job.limits_sent_unix = now
            for a in job.agents.values():
                self._send(job.socket, a, p.Limits(seq=job.seq, mem_limit_bytes=lim.mem_limit_bytes,
                                                   compute_share=lim.compute_share))
        if self.opt.enforce:
            self._apply_caps()
            self._check_compliance(now)

    def _apply_caps(self) -> None:
        """Driver caps follow each opportunistic job's memory limit, with compliance's tolerance on top
        (the agent keeps under its limit; the cap stops only a job that does not)."""
        if self.caps is None:
            return
        tol = self.opt.compliance
        for j in self.jobs.values():
            if j.job_class != "opportunistic" or j.limits.mem_limit_bytes is None:
                self._lift_caps(j.job_id)
                continue
            hard = int(j.limits.mem_limit_bytes * (1 + tol.mem_tolerance)) + tol.mem_slack_bytes
            candidates = [a.reg.pid for a in j.agents.values()] + self.gpu_pids_by_job.get(j.job_id, [])
            cgroup = next((c for c in map(lambda pid: self.caps.cgroup_of(j.job_id, pid), candidates) if c), None)
            if cgroup is None:
                continue  # no process of it seen yet: the next tick
            for gpu in j.gpus:
                try:
                    if self.caps.set(j.job_id, gpu, cgroup, hard):
                        log.info("job %s: driver memory cap %d MiB on GPU %d (%s)", j.job_id, hard >> 20, gpu, cgroup)
                except Exception as e:  # noqa: BLE001 - an NVML refusal costs the cap, never the sidecar
                    self.cap_errors += 1
                    self._rlog.warning(f"cap:{j.job_id}", "job %s: could not set its driver memory cap on GPU %d: %s",
                                       j.job_id, gpu, e)

    def _lift_caps(self, job_id: str) -> None:
        if self.caps is None:
            return
        try:
            self.caps.clear(job_id)
        except Exception as e:  # noqa: BLE001
            self.cap_errors += 1
            self._rlog.warning(f"cap:{job_id}", "job %s: could not lift its driver memory cap: %s", job_id, e)

    def _pause(self, job: RegisteredJob, reason: str) -> None:
        job.pause_seq += 1
        job.paused = True
        job.pause_sent_mono = time.monotonic()
        job.paused_unix = None
        self.pauses_total += 1
        log.warning("job %s: PAUSE in place: %s", job.job_id, reason)
        for a in job.agents.values():
            self._send(job.socket, a, p.Pause(seq=job.pause_seq, reason=reason[:4096]))
        self._report_now = True

    def _resume(self, job: RegisteredJob) -> None:
        if not job.paused:
            return
        job.paused = False
        job.resume_sent_mono = time.monotonic()
        if job.paused_unix is not None:
            self.pause_seconds_total += time.time() - job.paused_unix
        log.warning("job %s: RESUME: its GPU has room again", job.job_id)
        for a in job.agents.values():
            self._send(job.socket, a, p.Resume(seq=job.pause_seq))
        self._report_now = True

    def _check_compliance(self, now: float) -> None:
        """policy.node.compliance on what this node measures; a non-compliant job is asked to be requeued at
        once (by the coordinator; without one, it is sent a preemption notice, all a sidecar can do)."""
        self.noncompliant = {k: v for k, v in self.noncompliant.items() if k in self.jobs}
        guarded = {g for j in self.jobs.values() if j.job_class == "guaranteed" for g in j.gpus}
        nvml = self.telemetry.kind == "nvml"
        on_gpu = self.gpu_procs_by_job
        checked = []
        for j in self.jobs.values():
            if j.job_class != "opportunistic" or j.paused:
                continue  # a paused job is compliant by definition: it holds nothing and runs nothing
            unacked = any(a.acked_seq < j.seq for a in j.agents.values()) and j.limits_sent_unix is not None
            agent_mem = sum(self._agent_mem(a, {}) for a in j.agents.values())
            checked.append(compliance.JobCompliance(
                j.job_id, any(g in guarded for g in j.gpus), len(j.agents),
                len(on_gpu.get(j.job_id, ())) if nvml else None, j.limits_sent_unix if unacked else None,
                max(agent_mem, sum(on_gpu.get(j.job_id, ()))), j.limits.mem_limit_bytes))
        bad, self.compliance_since = compliance.step(checked, self.compliance_since, self.opt.compliance, now)
        for job_id, why in bad.items():
            job = self.jobs[job_id]
            if job_id in self.noncompliant or job.preempt is not None:
                continue
            gpu = next((g for g in job.gpus if g in guarded), job.gpus[0] if job.gpus else 0)
            req = PreemptRequest(job_id, gpu, why, now, now)
            self.noncompliant[job_id] = req
            self.noncompliant_total += 1
            log.warning("job %s: NON-COMPLIANT, asking for its requeue: %s", job_id, why)
            if self._uplink is not None:
                self._report_now = True
            else:
                job.preempt = req
                for a in job.agents.values():
                    self._send_preempt(job, a)

    def _tick(self, now: float, mono: float) -> None:
        expire_before = mono - AGENT_TIMEOUT_HEARTBEATS * self.opt.heartbeat_s
        for job in self.jobs.values():
            for ident, a in list(job.agents.items()):
                if a.last_seen < expire_before:
                    del job.agents[ident]
                    log.warning("job %s: agent pid %d silent for %.0f s; no longer counted", job.job_id,
                                a.reg.pid, mono - a.last_seen)
                elif mono - a.last_sent >= self.opt.heartbeat_s:
                    self._send(job.socket, a, p.Heartbeat())
        self._sample(now)
        self._check_health(mono)
        self._run_policy(now)
        self._publish_metrics()

    def _check_health(self, mono: float, force: bool = False) -> None:
        if not force and mono - self._health_checked < HEALTH_CHECK_S:
            return
        self._health_checked = mono
        paths = [self.dir.state_dir] + ([self.opt.hooks_state_dir] if self.opt.hooks_state_dir else [])
        why = health.node_problem(paths)
        if why != self.unhealthy:
            if why:
                log.error("node %s takes no new opportunistic job: %s", self.opt.node, why)
            else:
                log.warning("node %s takes opportunistic jobs again: its state directories have room", self.opt.node)
            self.unhealthy = why
            self._report_now = True

    def _node_state(self) -> p.NodeStateReply:
        proc_mem = {s.pid: s.memory_bytes for s in self.proc_samples if s.memory_bytes is not None}
        now = time.time()
        gpus = []
        for s in self.gpu_samples:
            on = [j for j in self.jobs.values() if s.index in j.gpus]
            gpus.append(p.GpuState(index=s.index, memory_used_bytes=s.memory_used_bytes,
                                   memory_total_bytes=s.memory_total_bytes, utilization=s.utilization,
                                   utilization_avg=min(1.0, self.util.average(s.index)),
                                   jobs=[j.job_id for j in on], util_measured=self._util_measured(on, now)))
        jobs = []
        for j in self.jobs.values():
            reports = [a for a in j.agents.values() if a.report is not None]
            track = self.policy_state.guaranteed.get(j.job_id)
            jobs.append(p.JobState(
                job_id=j.job_id, job_class=j.job_class, uid=j.uid, gpus=list(j.gpus),
                mem_limit_bytes=j.limits.mem_limit_bytes,
                mem_used_bytes=p.clamp_number(sum(self._agent_mem(a, proc_mem) for a in j.agents.values())),
                compute_share=j.limits.compute_share,
                iteration_ms=max((a.report.iteration_ms for a in reports), default=None),
                baseline_ms=track.baseline_ms if track else None,
                last_report_unix=max((a.report_unix for a in reports if a.report_unix), default=None),
                agents=len(j.agents), limits_seq=j.seq,
                acked_seq=min((a.acked_seq for a in j.agents.values()), default=0), paused=j.paused))
        pre = [p.PreemptState(job_id=j.job_id, reason=j.preempt.reason, requested_unix=j.preempt.requested_unix,
                              deadline_unix=j.preempt.deadline_unix)
               for j in self.jobs.values() if j.preempt is not None]
        return p.NodeStateReply(node=self.opt.node, telemetry=self.telemetry.kind,
                                sidecar_version=slurm_antman.__version__, gpus=gpus, jobs=jobs, preemptions=pre,
                                unhealthy=self.unhealthy[:1024])

    # --- coordinator uplink -----------------------------------------------------------------

    def _node_report(self) -> p.NodeReport:
        proc_mem = {s.pid: s.memory_bytes for s in self.proc_samples if s.memory_bytes is not None}
        now = time.time()
        gpus = []
        for s in self.gpu_samples:
            on = [j for j in self.jobs.values() if s.index in j.gpus]
            gpus.append(p.ReportGpu(index=s.index, mem_total_bytes=s.memory_total_bytes,
                                    mem_used_bytes=s.memory_used_bytes,
                                    util=min(1.0, max(0.0, self.util.average(s.index))),
                                    jobs=[j.job_id for j in on], util_measured=self._util_measured(on, now)))
        jobs = []
        for j in self.jobs.values():
            reports = [a.report.iteration_ms for a in j.agents.values() if a.report is not None]
            jobs.append(p.ReportJob(
                job_id=j.job_id, job_class=j.job_class, gpus=list(j.gpus), mem_limit_bytes=j.limits.mem_limit_bytes,
                mem_used_bytes=p.clamp_number(sum(self._agent_mem(a, proc_mem) for a in j.agents.values()))
                if j.agents else None,
                compute_share=j.limits.compute_share, iteration_ms=max(reports, default=None),
                last_checkpoint_unix=None,  # agents do not report checkpoints (yet): the job's start counts
                progress=self.progress.get(j.job_id), crawling_since_unix=self.policy_state.crawling.get(j.job_id),
                placement=j.placement, placement_note=j.note[:1024], paused=j.paused,
                pause_reason=(self.policy_state.paused[j.job_id].reason[:1024]
                              if j.paused and j.job_id in self.policy_state.paused else "")))
        pre = [p.ReportPreemptRequest(job_id=r.job_id, gpu=r.gpu, reason=r.reason, since_unix=r.requested_unix)
               for r in self.policy_state.preempted.values() if r.job_id in self.jobs and r.job_id not in self.noncompliant]
        pre += [p.ReportPreemptRequest(job_id=r.job_id, gpu=r.gpu, reason=r.reason[:4096], since_unix=r.requested_unix,
                                       noncompliant=True)
                for r in self.noncompliant.values() if r.job_id in self.jobs]
        return p.NodeReport(node=self.opt.node, telemetry=self.telemetry.kind, gpus=gpus, jobs=jobs,
                            preempt_requests=pre, unhealthy=self.unhealthy[:1024])

    def _on_coordinator(self, frames: list[bytes]) -> None:
        assert self._uplink is not None
        msg = self._uplink.receive(frames)
        if msg is None:
            return
        b = msg.body
        try:
            if isinstance(b, p.JobClassUpdate):
                self._set_class(b)
            elif isinstance(b, p.PreemptNotice):
                self._coordinator_preempt(b)
            elif isinstance(b, p.Bye):
                log.info("the coordinator said bye: %s", b.reason[:200])
        except p.ProtocolError as e:
            self._uplink.reply_error(e.code, e.message, msg.id)

    def _known(self, job_id: str, what: str) -> RegisteredJob:
        job = self.jobs.get(job_id)
        if job is None:
            raise p.ProtocolError(p.ErrorCode.unknown_job,
                                  f"{what}: job {job_id} is not registered on node {self.opt.node}")
        return job

    def _set_class(self, b: p.JobClassUpdate) -> None:
        job = self._known(b.job_id, "job_class_update")
        self._report_now = True
        if job.job_class == b.job_class:
            return
        log.warning("job %s: class %s -> %s (coordinator)", job.job_id, job.job_class, b.job_class)
        job.job_class = b.job_class
        if b.job_class == "guaranteed":
            job.preempt = None
            self.policy_state = replace(self.policy_state, preempted={
                k: v for k, v in self.policy_state.preempted.items() if k != job.job_id})
        self._save(job)
        self._run_policy(time.time())

    def _remember_avoid(self, job_id: str, gpus: list[int], now: float) -> None:
        self.avoid = {k: v for k, v in self.avoid.items() if v[1] > now}
        if len(self.avoid) >= AVOID_MAX_JOBS:
            self.avoid.pop(min(self.avoid, key=lambda k: self.avoid[k][1]))
        self.avoid[job_id] = (frozenset(gpus), now + AVOID_TTL_S)

    def _coordinator_preempt(self, b: p.PreemptNotice) -> None:
        job = self._known(b.job_id, "preempt_notice")
        if job.job_class != "opportunistic":
            raise p.ProtocolError(p.ErrorCode.bad_value, f"preempt_notice: job {job.job_id} is {job.job_class} on "
                                  f"node {self.opt.node}; only opportunistic jobs are preempted")
        self._report_now = True
        if job.preempt is not None:
            return  # a repeated notice keeps the first deadline
        now = time.time()
        if b.avoid_gpus:
            self._remember_avoid(job.job_id, b.avoid_gpus, now)
        gpu = job.gpus[0] if job.gpus else 0
        req = PreemptRequest(job.job_id, gpu, b.reason, now, now + b.grace_s)
        job.preempt = req
        # The coordinator's victim answers every request on its GPUs; the local policy asks again if
        # the room it frees is not enough.
        on_its_gpus = set(job.gpus)
        kept = {k: v for k, v in self.policy_state.preempted.items()
                if v.gpu not in on_its_gpus or (k in self.jobs and self.jobs[k].preempt is not None)}
        kept[job.job_id] = req
        self.policy_state = replace(self.policy_state, preempted=kept)
        log.warning("job %s: PREEMPTION notice from the coordinator (requeue in %.0f s): %s", job.job_id,
                    b.grace_s, b.reason)
        for a in job.agents.values():
            self._send_preempt(job, a)
        self._run_policy(now)

