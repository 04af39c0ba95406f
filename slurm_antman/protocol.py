"""The slurm-antman ZeroMQ protocol, version 1: messages between the node sidecar, the in-job agents,
the node's control clients (Prolog, Epilog, CLI) and the cluster coordinator. docs/protocol.md is the specification; this
module is its one implementation, shared by every side.

A message is two ZeroMQ frames: the marker ``b"ANTMAN"`` and a UTF-8 JSON envelope
``{"v", "type", "id", "ts", "ref", "body"}``. A ROUTER peer sees its routing identity frame(s) in
front; strip them before :func:`decode`.

Decoding is hand-rolled rather than pydantic because an agent sends a ``report`` per training
iteration, and the sidecar must keep up with many of them: validation is a table of small checker
closures compiled once per message type.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Optional

PROTOCOL_VERSION = 1
MARKER = b"ANTMAN"
MAX_MESSAGE_BYTES = 1 << 20
# Every number on the wire is within +-2^53 (what a JSON number holds exactly, RFC 8259 section 6),
# whatever narrower bound its field has: a peer can send nothing a sum or a str() cannot handle.
MAX_NUMBER = 1 << 53


def clamp_number(v: int) -> int:
    """A sum of bounded numbers (e.g. the memory several agents of one job report), kept sendable."""
    return min(v, MAX_NUMBER)

CONTROL_SOCKET_NAME = "control.sock"
AGENT_SOCKET_NAME = "agent.sock"
# The agent finds its endpoint in this variable (set from the Prolog's job env file).
ENDPOINT_ENV = "ANTMAN_SIDECAR_ENDPOINT"
# The other names C, Lua and Python share (docs/protocol.md, "Environment variables"; the tests
# compare each language's copy with docs/contracts.json).
ENV_CLASS = "ANTMAN_CLASS"
ENV_SPANK_CLASS = "SPANK_ANTMAN_CLASS"
ENV_JOB_SPANK_CLASS = "SLURM_SPANK_ANTMAN_CLASS"
ENV_JOB_ID = "ANTMAN_JOB_ID"
ENV_NODE = "ANTMAN_NODE"
ENV_GPUS = "ANTMAN_GPUS"
ENV_GPU_DEVICES = "ANTMAN_GPU_DEVICES"
ENV_REFUSED = "ANTMAN_REFUSED"
ENV_JOB_NODEID = "ANTMAN_JOB_NODEID"
ENV_PROLOG_FROM_SPANK = "ANTMAN_PROLOG_FROM_SPANK"
ENV_AGENT_DISABLE = "ANTMAN_AGENT_DISABLE"
ENV_CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"

JOB_ID_RE = re.compile(r"^[0-9]{1,10}$")
# Slurm node names; they also become key file names on the coordinator.
NODE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}$")
ENVELOPE_KEYS = frozenset(("v", "type", "id", "ts", "ref", "body"))
MAX_ID_LEN = 128


class ErrorCode(str, enum.Enum):
    """Codes carried by ``error`` messages and by :class:`ProtocolError`. docs/protocol.md lists them."""

    bad_frames = "bad_frames"
    too_large = "too_large"
    bad_json = "bad_json"
    bad_envelope = "bad_envelope"
    version_mismatch = "version_mismatch"
    unknown_type = "unknown_type"
    missing_field = "missing_field"
    extra_field = "extra_field"
    bad_type = "bad_type"
    bad_value = "bad_value"
    wrong_direction = "wrong_direction"
    not_registered = "not_registered"
    unknown_job = "unknown_job"
    forbidden = "forbidden"
    internal = "internal"
    # The query channel's (a munge credential that munged refused, or a peer asking too often).
    bad_credential = "bad_credential"
    expired_credential = "expired_credential"
    replayed_credential = "replayed_credential"
    rate_limited = "rate_limited"


class ProtocolError(Exception):
    """A message that cannot be used. ``ref`` is the offending message's id when it could be read."""

    def __init__(self, code: ErrorCode, message: str, ref: Optional[str] = None,
                 peer_version: Optional[int] = None):
        self.code = ErrorCode(code)
        self.message = message
        self.ref = ref
        self.peer_version = peer_version
        super().__init__(f"{self.code.value}: {message}")


# ---------------------------------------------------------------------------------------------
# Field declarations. Each body field carries its wire type and constraints in dataclass
# metadata, so one declaration drives both the Python API and the validator.

_MISSING = dataclasses.MISSING


def _f(kind: Any, *, nullable: bool = False, ge: Optional[float] = None, gt: Optional[float] = None,
       le: Optional[float] = None, choices: Optional[Iterable[str]] = None,
       pattern: Optional[re.Pattern[str]] = None, max_len: Optional[int] = None,
       default: Any = _MISSING) -> Any:
    meta = dict(kind=kind, nullable=nullable, ge=ge, gt=gt, le=le,
                choices=frozenset(choices) if choices is not None else None,
                pattern=pattern, max_len=max_len)
    return field(default=default, metadata=meta)


JOB_CLASSES = ("guaranteed", "opportunistic")
AGENT_CLASSES = ("guaranteed", "opportunistic", "none")
DEVICES = ("cuda", "cpu")
THROTTLE_MODES = ("off", "iteration", "launch")
TELEMETRY_KINDS = ("nvml", "emulated")
PLACEMENTS = ("requested", "fit", "fallback", "wait")
FEATURE_PAUSE = "pause"  # register.features: the agent answers pause / resume


def _job_id(**kw: Any) -> Any:
    return _f(str, pattern=JOB_ID_RE, **kw)


def _bytes_(nullable: bool = False, **kw: Any) -> Any:
    return _f(int, ge=0, nullable=nullable, **kw)


def _text(**kw: Any) -> Any:
    return _f(str, max_len=kw.pop("max_len", 4096), **kw)


class Body:
    """Base of all message bodies. ``TYPE`` is the wire ``type``."""

    TYPE: ClassVar[str] = ""
    __slots__ = ()


_dc = dataclass(slots=True, kw_only=True)

# --- agent channel: per-job ROUTER (sidecar) <-> DEALER (agent) ------------------------------


@_dc
class Register(Body):
    TYPE: ClassVar[str] = "register"
    job_id: str = _job_id()
    pid: int = _f(int, ge=1)
    rank: int = _f(int, ge=0)
    local_rank: int = _f(int, ge=0)
    world_size: int = _f(int, ge=1)
    hostname: str = _text(max_len=255)
    agent_version: str = _text(max_len=64)
    torch_version: str = _text(max_len=64)
    device: str = _f(str, choices=DEVICES)
    job_class: str = _f(str, choices=AGENT_CLASSES)
    cuda_visible_devices: Optional[str] = _text(max_len=1024, nullable=True, default=None)
    # What this agent can do beyond the base protocol: "pause" (it answers pause/resume). Optional:
    # an older agent sends none, and the sidecar never sends it a message it would not know. Names
    # a sidecar does not know are ignored, so a newer agent registers with an older sidecar.
    features: tuple = _f(list[str], max_len=32, default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", tuple(self.features))  # one type, however it was built


@_dc
class Registered(Body):
    TYPE: ClassVar[str] = "registered"
    job_id: str = _job_id()
    job_class: str = _f(str, choices=JOB_CLASSES)
    seq: int = _f(int, ge=0)
    mem_limit_bytes: Optional[int] = _bytes_(nullable=True)
    compute_share: float = _f(float, gt=0.0, le=1.0)
    heartbeat_s: float = _f(float, gt=0.0, le=3600.0)
    throttle: str = _f(str, choices=THROTTLE_MODES)


@_dc
class Report(Body):
    TYPE: ClassVar[str] = "report"
    iteration: int = _f(int, ge=0)
    iterations: int = _f(int, ge=1)
    iteration_ms: float = _f(float, ge=0.0)
    busy_ms: float = _f(float, ge=0.0)
    mem_allocated_bytes: int = _bytes_()
    mem_reserved_bytes: int = _bytes_()
    mem_peak_bytes: int = _bytes_()
    spilled_bytes: int = _bytes_()
    limits_seq: int = _f(int, ge=0)


@_dc
class Limits(Body):
    TYPE: ClassVar[str] = "limits"
    seq: int = _f(int, ge=1)
    mem_limit_bytes: Optional[int] = _bytes_(nullable=True)
    compute_share: float = _f(float, gt=0.0, le=1.0)


@_dc
class Ack(Body):
    TYPE: ClassVar[str] = "ack"
    seq: int = _f(int, ge=0)
    applied_iteration: int = _f(int, ge=0)


@_dc
class Preempt(Body):
    TYPE: ClassVar[str] = "preempt"
    deadline_unix: float = _f(float, ge=0.0)
    grace_s: float = _f(float, ge=0.0)
    reason: str = _text()


@_dc
class Pause(Body):
    """Sidecar -> agent: at the next iteration boundary, move the job's GPU state to host memory, free
    the device memory, ack with ``paused`` and block the training thread until ``resume``."""
    TYPE: ClassVar[str] = "pause"
    seq: int = _f(int, ge=1)
    reason: str = _text()


@_dc
class Paused(Body):
    TYPE: ClassVar[str] = "paused"
    seq: int = _f(int, ge=1)
    bytes_freed: int = _bytes_()     # device memory given back (reserved before - after)
    bytes_moved: int = _bytes_()     # state copied to host memory
    pause_ms: float = _f(float, ge=0.0)  # from the boundary to the memory freed


@_dc
class Resume(Body):
    TYPE: ClassVar[str] = "resume"
    seq: int = _f(int, ge=1)         # the pause it ends


@_dc
class Resumed(Body):
    TYPE: ClassVar[str] = "resumed"
    seq: int = _f(int, ge=1)
    resume_ms: float = _f(float, ge=0.0)  # from ``resume`` arriving to the training thread running again


@_dc
class Heartbeat(Body):
    TYPE: ClassVar[str] = "heartbeat"


@_dc
class Error(Body):
    TYPE: ClassVar[str] = "error"
    code: str = _f(str, choices=[c.value for c in ErrorCode])
    message: str = _text()


@_dc
class Bye(Body):
    TYPE: ClassVar[str] = "bye"
    reason: str = _text(max_len=1024)


# --- control channel: root-only ROUTER (sidecar) <-> REQ/DEALER (Prolog, Epilog, CLI) -----------


@_dc
class JobRegister(Body):
    TYPE: ClassVar[str] = "job_register"
    job_id: str = _job_id()
    uid: int = _f(int, ge=0)
    gid: Optional[int] = _f(int, ge=0, nullable=True, default=None)
    user: str = _text(max_len=256)
    job_class: str = _f(str, choices=JOB_CLASSES)
    gpus: int = _f(int, ge=1, le=64)
    physical_gpus: Optional[list] = _f(list[int], nullable=True, default=None)
    account: Optional[str] = _f(str, nullable=True, default=None)  # Slurm account, for metric labels
    # The client can requeue the job when no GPU qualifies (placement "wait"); an older Prolog never
    # sends it, so it is never answered with a placement it does not know.
    may_wait: bool = _f(bool, default=False)


@_dc
class JobRegisterReply(Body):
    TYPE: ClassVar[str] = "job_register_reply"
    job_id: str = _job_id()
    gpus: list = _f(list[int])
    endpoint: str = _text()
    placement: str = _f(str, choices=PLACEMENTS)
    note: str = _text()


@_dc
class JobRetire(Body):
    TYPE: ClassVar[str] = "job_retire"
    job_id: str = _job_id()


@_dc
class JobRetireReply(Body):
    TYPE: ClassVar[str] = "job_retire_reply"
    job_id: str = _job_id()
    known: bool = _f(bool)


@_dc
class NodeState(Body):
    TYPE: ClassVar[str] = "node_state"


@_dc
class GpuState:
    index: int = _f(int, ge=0)
    memory_used_bytes: int = _bytes_()
    memory_total_bytes: int = _bytes_()
    utilization: float = _f(float, ge=0.0, le=1.0)
    utilization_avg: float = _f(float, ge=0.0, le=1.0)
    jobs: list = _f(list[str])
    # as node_report's: False while a guaranteed job on it is too new to show in utilization_avg
    util_measured: bool = _f(bool, default=True)


@_dc
class JobState:
    job_id: str = _job_id()
    job_class: str = _f(str, choices=JOB_CLASSES)
    uid: int = _f(int, ge=0)
    gpus: list = _f(list[int])
    mem_limit_bytes: Optional[int] = _bytes_(nullable=True)
    mem_used_bytes: int = _bytes_()
    compute_share: float = _f(float, gt=0.0, le=1.0)
    iteration_ms: Optional[float] = _f(float, ge=0.0, nullable=True)
    baseline_ms: Optional[float] = _f(float, ge=0.0, nullable=True)
    last_report_unix: Optional[float] = _f(float, ge=0.0, nullable=True)
    agents: int = _f(int, ge=0)
    limits_seq: int = _f(int, ge=0)
    acked_seq: int = _f(int, ge=0)
    paused: bool = _f(bool, default=False)  # paused in place (issue 16); optional, older sidecars: false


@_dc
class PreemptState:
    job_id: str = _job_id()
    reason: str = _text()
    requested_unix: float = _f(float, ge=0.0)
    deadline_unix: float = _f(float, ge=0.0)


@_dc
class NodeStateReply(Body):
    TYPE: ClassVar[str] = "node_state_reply"
    node: str = _text(max_len=255)
    telemetry: str = _f(str, choices=TELEMETRY_KINDS)
    sidecar_version: str = _text(max_len=64)
    gpus: list = _f(list[GpuState])
    jobs: list = _f(list[JobState])
    preemptions: list = _f(list[PreemptState])
    unhealthy: str = _text(max_len=1024, default="")  # as in node_report


# --- uplink: coordinator ROUTER (CURVE server) <-> one DEALER per node sidecar (CURVE client) --------


@_dc
class ReportGpu:
    index: int = _f(int, ge=0)
    mem_total_bytes: int = _bytes_()
    mem_used_bytes: int = _bytes_()
    util: float = _f(float, ge=0.0, le=1.0)
    jobs: list = _f(list[str], pattern=JOB_ID_RE)
    # False while a guaranteed job on the GPU has not yet run a utilisation window of iterations:
    # ``util`` does not show it yet. Optional: an older sidecar is read as having measured.
    util_measured: bool = _f(bool, default=True)


@_dc
class ReportJob:
    job_id: str = _job_id()
    job_class: str = _f(str, choices=JOB_CLASSES)
    gpus: list = _f(list[int], ge=0)
    mem_limit_bytes: Optional[int] = _bytes_(nullable=True)
    mem_used_bytes: Optional[int] = _bytes_(nullable=True)
    compute_share: float = _f(float, gt=0.0, le=1.0)
    iteration_ms: Optional[float] = _f(float, ge=0.0, nullable=True)
    last_checkpoint_unix: Optional[float] = _f(float, ge=0.0, nullable=True)
    # Opportunistic jobs: the fraction of its solo rate it makes, and since when it crawls (both
    # optional: a sidecar that does not send them is read as having measured nothing).
    progress: Optional[float] = _f(float, ge=0.0, le=1.0, nullable=True, default=None)
    crawling_since_unix: Optional[float] = _f(float, ge=0.0, nullable=True, default=None)
    # How the sidecar placed the job and why (job_register_reply's), for `antman explain`; optional.
    placement: Optional[str] = _f(str, choices=PLACEMENTS, nullable=True, default=None)
    placement_note: Optional[str] = _text(max_len=1024, nullable=True, default=None)
    # Paused in place by the sidecar (issue 16), and why; optional: older sidecars never pause.
    paused: bool = _f(bool, default=False)
    pause_reason: str = _text(max_len=1024, default="")


@_dc
class ReportPreemptRequest:
    job_id: str = _job_id()
    gpu: int = _f(int, ge=0)
    reason: str = _text()
    since_unix: float = _f(float, ge=0.0)
    # This very job must go (slurm_antman.policy.node.compliance), not whichever job on the GPU loses least.
    noncompliant: bool = _f(bool, default=False)


@_dc
class NodeReport(Body):
    TYPE: ClassVar[str] = "node_report"
    node: str = _f(str, pattern=NODE_NAME_RE)
    telemetry: str = _f(str, choices=TELEMETRY_KINDS)
    gpus: list = _f(list[ReportGpu])
    jobs: list = _f(list[ReportJob])
    preempt_requests: list = _f(list[ReportPreemptRequest])
    # Why no opportunistic job may start on this node now although its GPUs may have room (its state
    # directories full: nothing it would place could be recorded); "" = healthy. Optional: an older
    # sidecar is read as healthy.
    unhealthy: str = _text(max_len=1024, default="")


@_dc
class NodeReportAck(Body):
    TYPE: ClassVar[str] = "node_report_ack"
    node: str = _f(str, pattern=NODE_NAME_RE)
    received_unix: float = _f(float, ge=0.0)


@_dc
class JobClassUpdate(Body):
    TYPE: ClassVar[str] = "job_class_update"
    job_id: str = _job_id()
    job_class: str = _f(str, choices=JOB_CLASSES)


@_dc
class PreemptNotice(Body):
    TYPE: ClassVar[str] = "preempt_notice"
    job_id: str = _job_id()
    grace_s: float = _f(float, ge=0.0, le=86400.0)
    reason: str = _text()
    # Placement memory: the node's GPUs the job is moved off; when Slurm brings it back to this node
    # the sidecar places it elsewhere if it can (optional: an older coordinator sends none).
    avoid_gpus: Optional[list] = _f(list[int], ge=0, le=1023, nullable=True, default=None)


# --- query channel: coordinator ROUTER <-> the `antman` CLI of any user on any host (DEALER) -----------
# Each request carries a munge credential whose payload is query_payload() of the request itself: the
# coordinator takes the caller's uid from munged, never from the message, and the credential cannot be
# moved to another request.

MAX_CREDENTIAL_CHARS = 8192


def _credential() -> Any:
    return _f(str, max_len=MAX_CREDENTIAL_CHARS)


@_dc
class QueryCaller:
    uid: int = _f(int, ge=0)                                     # as munged decoded it
    user: Optional[str] = _text(max_len=256, nullable=True)      # its name on the coordinator's host
    admin: bool = _f(bool)                                       # sees every job's details


@_dc
class QueryJob:
    """A job on one node, as that node's sidecar last reported it. ``visible`` false: not the caller's
    job, and every detail field is null (so null means "hidden", not "unlimited" or "unknown")."""
    job_id: str = _job_id()
    node: str = _f(str, pattern=NODE_NAME_RE)
    job_class: str = _f(str, choices=JOB_CLASSES)
    gpus: list = _f(list[int], ge=0)
    visible: bool = _f(bool)
    mem_limit_bytes: Optional[int] = _bytes_(nullable=True)
    mem_used_bytes: Optional[int] = _bytes_(nullable=True)
    compute_share: Optional[float] = _f(float, gt=0.0, le=1.0, nullable=True)
    iteration_ms: Optional[float] = _f(float, ge=0.0, nullable=True)
    paused: Optional[bool] = _f(bool, nullable=True)


@_dc
class QueryGpu:
    index: int = _f(int, ge=0)
    memory_used_bytes: int = _bytes_()
    memory_total_bytes: int = _bytes_()
    utilization: float = _f(float, ge=0.0, le=1.0)               # averaged over the utilisation window
    util_measured: bool = _f(bool)
    jobs: list = _f(list[str], pattern=JOB_ID_RE)


@_dc
class QueryNode:
    node: str = _f(str, pattern=NODE_NAME_RE)
    telemetry: str = _f(str, choices=TELEMETRY_KINDS)
    report_unix: float = _f(float, ge=0.0)                       # when the coordinator received the report
    unhealthy: str = _text(max_len=1024)
    gpus: list = _f(list[QueryGpu])
    jobs: list = _f(list[QueryJob])


@_dc
class QueryJobs(Body):
    TYPE: ClassVar[str] = "query_jobs"
    credential: str = _credential()
    page: int = _f(int, ge=0)


@_dc
class QueryJobsReply(Body):
    TYPE: ClassVar[str] = "query_jobs_reply"
    caller: QueryCaller = _f(QueryCaller)
    page: int = _f(int, ge=0)
    pages: int = _f(int, ge=1)
    jobs: list = _f(list[QueryJob])


@_dc
class QueryNodes(Body):
    TYPE: ClassVar[str] = "query_nodes"
    credential: str = _credential()
    page: int = _f(int, ge=0)


@_dc
class QueryNodesReply(Body):
    TYPE: ClassVar[str] = "query_nodes_reply"
    caller: QueryCaller = _f(QueryCaller)
    page: int = _f(int, ge=0)
    pages: int = _f(int, ge=1)
    nodes: list = _f(list[QueryNode])


@_dc
class QueryExplain(Body):
    TYPE: ClassVar[str] = "query_explain"
    credential: str = _credential()
    job_id: str = _job_id()


@_dc
class QueryExplainReply(Body):
    TYPE: ClassVar[str] = "query_explain_reply"
    caller: QueryCaller = _f(QueryCaller)
    job_id: str = _job_id()
    owner: Optional[str] = _text(max_len=256, nullable=True)     # the job's user, when known
    records: list = _f(list[dict])                               # audit-log records, oldest first
    omitted: int = _f(int, ge=0)                                 # older records left out to fit one message


BODY_TYPES: dict[str, type[Body]] = {
    cls.TYPE: cls for cls in (
        Register, Registered, Report, Limits, Ack, Preempt, Pause, Paused, Resume, Resumed, Heartbeat, Error, Bye,
        JobRegister, JobRegisterReply, JobRetire, JobRetireReply, NodeState, NodeStateReply,
        NodeReport, NodeReportAck, JobClassUpdate, PreemptNotice,
        QueryJobs, QueryJobsReply, QueryNodes, QueryNodesReply, QueryExplain, QueryExplainReply,
    )
}

# Which types each receiver accepts; anything else is answered with `wrong_direction`.
AGENT_TO_SIDECAR = frozenset({"register", "report", "ack", "paused", "resumed", "heartbeat", "error", "bye"})
SIDECAR_TO_AGENT = frozenset({"registered", "limits", "preempt", "pause", "resume", "heartbeat", "error", "bye"})
CONTROL_REQUESTS = frozenset({"job_register", "job_retire", "node_state", "heartbeat"})
CONTROL_REPLIES = frozenset({"job_register_reply", "job_retire_reply", "node_state_reply",
                             "heartbeat", "error"})
SIDECAR_TO_COORDINATOR = frozenset({"node_report", "heartbeat", "error", "bye"})
COORDINATOR_TO_SIDECAR = frozenset({"node_report_ack", "job_class_update", "preempt_notice", "heartbeat",
                                    "error", "bye"})
QUERY_REQUESTS = frozenset({"query_jobs", "query_nodes", "query_explain", "heartbeat"})
QUERY_REPLIES = frozenset({"query_jobs_reply", "query_nodes_reply", "query_explain_reply", "heartbeat", "error"})


# ---------------------------------------------------------------------------------------------
# Validator compilation.

# Checkers take (value, where, name); the error path text is only built when raising, which keeps
# the per-report cost down.
Checker = Callable[[Any, str, str], Any]


def _bounds_text(m: dict) -> str:
    parts = []
    if m["gt"] is not None:
        parts.append(f"> {m['gt']}")
    if m["ge"] is not None:
        parts.append(f">= {m['ge']}")
    if m["le"] is not None:
        parts.append(f"<= {m['le']}")
    return " and ".join(parts)


def _at(where: str, name: str) -> str:
    return f"{where}.{name}" if name else where


def _jtype(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


def _scalar_checker(kind: Any, m: dict) -> Checker:
    if kind is int or kind is float:
        m = dict(m, le=MAX_NUMBER if m["le"] is None else m["le"])
        if m["ge"] is None and m["gt"] is None:
            m["ge"] = -MAX_NUMBER
    ge, gt, le = m["ge"], m["gt"], m["le"]
    choices, pattern, max_len = m["choices"], m["pattern"], m["max_len"]
    bounded = ge is not None or gt is not None or le is not None

    def bad_type(v: Any, where: str, name: str, want: str) -> ProtocolError:
        return ProtocolError(ErrorCode.bad_type, f"{_at(where, name)}: expected {want}, got {_jtype(v)}")

    def check_range(v: Any, where: str, name: str) -> None:
        if (ge is not None and v < ge) or (gt is not None and v <= gt) or (le is not None and v > le):
            shown = f"an integer of {v.bit_length()} bits" if type(v) is int and v.bit_length() > 64 else repr(v)
            raise ProtocolError(ErrorCode.bad_value, f"{_at(where, name)}: {shown} is out of range (must be {_bounds_text(m)})")

    if kind is int:
        def check(v: Any, where: str, name: str) -> Any:
            if type(v) is not int:
                raise bad_type(v, where, name, "integer")
            if bounded:
                check_range(v, where, name)
            return v
    elif kind is float:
        def check(v: Any, where: str, name: str) -> Any:
            t = type(v)
            if t is not float and t is not int:
                raise bad_type(v, where, name, "number")
            v = float(v)
            if not math.isfinite(v):
                raise ProtocolError(ErrorCode.bad_value, f"{_at(where, name)}: {v!r} is not a finite number")
            if bounded:
                check_range(v, where, name)
            return v
    elif kind is bool:
        def check(v: Any, where: str, name: str) -> Any:
            if type(v) is not bool:
                raise bad_type(v, where, name, "boolean")
            return v
    elif kind is str:
        def check(v: Any, where: str, name: str) -> Any:
            if type(v) is not str:
                raise bad_type(v, where, name, "string")
            if choices is not None and v not in choices:
                raise ProtocolError(ErrorCode.bad_value,
                                    f"{_at(where, name)}: {v!r} is not allowed; allowed: {', '.join(sorted(choices))}")
            if pattern is not None and not pattern.match(v):
                raise ProtocolError(ErrorCode.bad_value, f"{_at(where, name)}: {v!r} does not match {pattern.pattern}")
            if max_len is not None and len(v) > max_len:
                raise ProtocolError(ErrorCode.bad_value, f"{_at(where, name)}: longer than {max_len} characters")
            return v
    elif dataclasses.is_dataclass(kind):
        def check(v: Any, where: str, name: str) -> Any:
            if type(v) is not dict:
                raise bad_type(v, where, name, "object")
            return _build(kind, v, _at(where, name))
    elif kind is dict:
        # A free-form JSON object (an audit-log record): its shape is the audit log's, not the protocol's.
        def check(v: Any, where: str, name: str) -> Any:
            if type(v) is not dict:
                raise bad_type(v, where, name, "object")
            return v
    else:
        raise TypeError(f"unsupported field kind {kind!r}")
    return check


def _checker(kind: Any, m: dict) -> Checker:
    if getattr(kind, "__origin__", None) is list:
        (item_kind,) = kind.__args__
        item = _scalar_checker(item_kind, dict(m, nullable=False))

        def check_list(v: Any, where: str, name: str) -> Any:
            if type(v) is not list:
                raise ProtocolError(ErrorCode.bad_type, f"{_at(where, name)}: expected array, got {_jtype(v)}")
            if len(v) > 4096:
                raise ProtocolError(ErrorCode.bad_value, f"{_at(where, name)}: more than 4096 items")
            return [item(x, where, f"{name}[{i}]") for i, x in enumerate(v)]
        inner = check_list
    else:
        inner = _scalar_checker(kind, m)
    if not m["nullable"]:
        return inner

    def check_nullable(v: Any, where: str, name: str) -> Any:
        return None if v is None else inner(v, where, name)
    return check_nullable


@dataclass(frozen=True)
class _Spec:
    names: frozenset
    required: tuple
    fields: tuple  # (name, checker, default or _MISSING)


_SPECS: dict[type, _Spec] = {}


def _spec(cls: type) -> _Spec:
    spec = _SPECS.get(cls)
    if spec is None:
        fields = []
        for fd in dataclasses.fields(cls):
            fields.append((fd.name, _checker(fd.metadata["kind"], fd.metadata), fd.default))
        spec = _Spec(frozenset(n for n, _, _ in fields),
                     tuple(n for n, _, d in fields if d is _MISSING), tuple(fields))
        _SPECS[cls] = spec
    return spec


def _build(cls: type, data: dict, where: str) -> Any:
    spec = _spec(cls)
    if len(data) != len(spec.names) or not spec.names.issuperset(data):
        extra = sorted(str(k) for k in data if k not in spec.names)
        if extra:
            raise ProtocolError(ErrorCode.extra_field,
                                f"{where}: unknown field(s) {', '.join(extra)}; allowed: {', '.join(sorted(spec.names))}")
    kwargs = {}
    for name, check, default in spec.fields:
        if name in data:
            kwargs[name] = check(data[name], where, name)
        elif default is _MISSING:
            raise ProtocolError(ErrorCode.missing_field, f"{where}: missing field {name!r}")
        else:
            kwargs[name] = default
    return cls(**kwargs)


for _cls in (*BODY_TYPES.values(), GpuState, JobState, PreemptState, ReportGpu, ReportJob, ReportPreemptRequest,
             QueryCaller, QueryJob, QueryGpu, QueryNode):
    _spec(_cls)


# ---------------------------------------------------------------------------------------------
# Envelope.

_id_prefix = f"{os.getpid():x}-{os.urandom(3).hex()}"
_id_counter = itertools.count(1)


def new_id() -> str:
    """A message id unique to this process for its lifetime (cheaper than a uuid per report)."""
    return f"{_id_prefix}-{next(_id_counter)}"


@dataclass(slots=True)
class Message:
    body: Body
    id: str = field(default_factory=new_id)
    ref: Optional[str] = None
    ts: float = field(default_factory=time.time)
    v: int = PROTOCOL_VERSION

    @property
    def type(self) -> str:
        return self.body.TYPE


def message(body: Body, ref: Optional[str] = None) -> Message:
    return Message(body=body, ref=ref)


def reply(to: Message, body: Body) -> Message:
    return Message(body=body, ref=to.id)


def error_message(code: ErrorCode, text: str, ref: Optional[str] = None) -> Message:
    return Message(body=Error(code=ErrorCode(code).value, message=text[:4096]), ref=ref)


def _to_wire(obj: Any) -> Any:
    if type(obj) is list or type(obj) is tuple:
        return [_to_wire(x) for x in obj]
    spec = _SPECS.get(type(obj))
    if spec is not None:
        return {name: _to_wire(getattr(obj, name)) for name, _, _ in spec.fields}
    return obj


def body_dict(body: Body) -> dict:
    return _to_wire(body)


def encode(msg: Message) -> list[bytes]:
    """Frames for ``msg`` (marker + JSON). Validates the body so a sender bug fails at the sender."""
    body = msg.body
    cls = type(body)
    if BODY_TYPES.get(getattr(cls, "TYPE", None)) is not cls:
        raise ProtocolError(ErrorCode.unknown_type, f"{cls.__name__} is not a protocol message body")
    data = _to_wire(body)
    _build(cls, data, cls.TYPE)
    env = {"v": msg.v, "type": cls.TYPE, "id": msg.id, "ts": msg.ts, "ref": msg.ref, "body": data}
    try:
        raw = json.dumps(env, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
        raise ProtocolError(ErrorCode.bad_value, f"{cls.TYPE}: cannot encode: {e}") from None
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ProtocolError(ErrorCode.too_large, f"{cls.TYPE}: {len(raw)} bytes > {MAX_MESSAGE_BYTES}")
    return [MARKER, raw]


def decode(frames: list, accept: Optional[frozenset] = None) -> Message:
    """The message in ``frames`` (routing identities already stripped), or a :class:`ProtocolError`.

    ``accept`` limits the types this receiver takes (e.g. :data:`AGENT_TO_SIDECAR`); another valid
    type raises ``wrong_direction``.
    """
    if len(frames) != 2:
        raise ProtocolError(ErrorCode.bad_frames,
                            f"expected 2 frames (marker, JSON envelope), got {len(frames)}")
    marker, raw = frames
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raw = getattr(raw, "bytes", raw)
    if bytes(getattr(marker, "bytes", marker)) != MARKER:
        raise ProtocolError(ErrorCode.bad_frames, f"first frame must be {MARKER!r}")
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ProtocolError(ErrorCode.too_large, f"message of {len(raw)} bytes > {MAX_MESSAGE_BYTES}")
    try:
        env = json.loads(raw)
    except RecursionError:
        raise ProtocolError(ErrorCode.bad_json, "envelope is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(ErrorCode.bad_json, f"envelope is not valid UTF-8 JSON: {e}") from None
    if type(env) is not dict:
        raise ProtocolError(ErrorCode.bad_envelope, f"envelope must be a JSON object, got {_jtype(env)}")
    mid = env.get("id")
    ref = mid if type(mid) is str and 0 < len(mid) <= MAX_ID_LEN else None
    v = env.get("v")
    if type(v) is not int:
        raise ProtocolError(ErrorCode.bad_envelope, "envelope field 'v' (protocol major version) must be an integer"
                            if "v" in env else "envelope has no 'v' (protocol major version)", ref)
    if v != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.version_mismatch,
                            f"peer speaks antman protocol v{v}, this side speaks v{PROTOCOL_VERSION}",
                            ref, peer_version=v)
    if len(env) != len(ENVELOPE_KEYS) or not ENVELOPE_KEYS.issuperset(env):
        missing = sorted(ENVELOPE_KEYS.difference(env))
        if missing:
            raise ProtocolError(ErrorCode.missing_field, f"envelope: missing field(s) {', '.join(missing)}", ref)
        extra = sorted(str(k) for k in env if k not in ENVELOPE_KEYS)
        raise ProtocolError(ErrorCode.extra_field, f"envelope: unknown field(s) {', '.join(extra)}", ref)
    if ref is None:
        raise ProtocolError(ErrorCode.bad_envelope,
                            f"envelope field 'id' must be a non-empty string of at most {MAX_ID_LEN} characters")
    mtype, ts, mref, body = env["type"], env["ts"], env["ref"], env["body"]
    if type(mtype) is not str:
        raise ProtocolError(ErrorCode.bad_envelope, "envelope field 'type' must be a string", ref)
    if (type(ts) is not float and type(ts) is not int) or not math.isfinite(ts):
        raise ProtocolError(ErrorCode.bad_envelope, "envelope field 'ts' must be a finite number", ref)
    if mref is not None and (type(mref) is not str or len(mref) > MAX_ID_LEN):
        raise ProtocolError(ErrorCode.bad_envelope, "envelope field 'ref' must be null or a message id", ref)
    if type(body) is not dict:
        raise ProtocolError(ErrorCode.bad_envelope, f"envelope field 'body' must be an object, got {_jtype(body)}", ref)
    cls = BODY_TYPES.get(mtype)
    if cls is None:
        raise ProtocolError(ErrorCode.unknown_type,
                            f"unknown message type {mtype[:64]!r}; known: {', '.join(sorted(BODY_TYPES))}", ref)
    if accept is not None and mtype not in accept:
        raise ProtocolError(ErrorCode.wrong_direction,
                            f"{mtype!r} is not accepted here; accepted: {', '.join(sorted(accept))}", ref)
    try:
        parsed = _build(cls, body, mtype)
    except ProtocolError as e:
        e.ref = ref
        raise
    return Message(body=parsed, id=mid, ref=mref, ts=float(ts), v=v)


def query_payload(msg_id: str, body: Body) -> bytes:
    """What a query request's munge credential carries: the request itself, its credential left out,
    as canonical JSON. The coordinator recomputes it from the message it got and compares."""
    data = {k: v for k, v in _to_wire(body).items() if k != "credential"}
    doc = {"v": PROTOCOL_VERSION, "type": body.TYPE, "id": msg_id, "body": data}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


# ---------------------------------------------------------------------------------------------
# Endpoints.

def control_path(socket_dir: str) -> str:
    return os.path.join(socket_dir, CONTROL_SOCKET_NAME)


def job_dir(socket_dir: str, job_id: str) -> str:
    if not JOB_ID_RE.match(job_id):
        raise ValueError(f"job id {job_id!r} must be 1-10 digits")
    return os.path.join(socket_dir, "jobs", job_id)


def agent_path(socket_dir: str, job_id: str) -> str:
    return os.path.join(job_dir(socket_dir, job_id), AGENT_SOCKET_NAME)


def ipc(path: str) -> str:
    return "ipc://" + path
