"""Every message body of the protocol, channel by channel (agent, control, uplink, query), and which
types each receiver accepts. docs/protocol.md describes them field by field."""

from __future__ import annotations

from dataclasses import field
from typing import Any, ClassVar, Optional

from .spec import (
    AGENT_CLASSES, DEVICES, JOB_CLASSES, MAX_JOB_GPUS, JOB_ID_RE, MAX_SLOT_PAGE_PATH, NODE_NAME_RE, PLACEMENTS,
    SLOT_PAGE_RE, SLOT_ROLES, TELEMETRY_KINDS, THROTTLE_MODES, Body, ErrorCode, _bytes_, _dc, _f, _job_id, _text,
)

# --- agent channel: per-job ROUTER (sidecar) <-> DEALER (agent) ------------------------------


def _slot_page() -> Any:
    return _f(str, nullable=True, pattern=SLOT_PAGE_RE, max_len=MAX_SLOT_PAGE_PATH, default=None, omit_default=True)


def _slot_role() -> Any:
    return _f(str, nullable=True, choices=SLOT_ROLES, default=None, omit_default=True)


def _check_slot_pair(page: Optional[str], role: Optional[str]) -> None:
    if (page is None) != (role is None):
        raise ValueError(f"slot_page and slot_role come together or not at all, got slot_page={page!r}, "
                         f"slot_role={role!r}")


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
    # The idle-slot page of the agent's GPU and what the agent does with it (docs/protocol.md, "The
    # idle-slot page"); sent only to agents whose register.features has "slots", and left off the wire
    # while null, so an older agent never meets them.
    slot_page: Optional[str] = _slot_page()
    slot_role: Optional[str] = _slot_role()

    def __post_init__(self) -> None:
        _check_slot_pair(self.slot_page, self.slot_role)


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
    slot_page: Optional[str] = _slot_page()    # as in registered; null: no page (any more)
    slot_role: Optional[str] = _slot_role()
    # Host bytes the job may keep pinned for a pause (feature "pin"); 0: none. Left out while 0, so an
    # agent older than the field never meets it.
    pin_bytes: int = _bytes_(default=0, omit_default=True)

    def __post_init__(self) -> None:
        _check_slot_pair(self.slot_page, self.slot_role)


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
class Width(Body):
    """Sidecar -> the agent of local rank 0 of an elastic job (docs/elastic.md), only if its
    ``register.features`` has ``width``: from the next iteration boundary the job runs on these GPUs.
    The agent runs the job's checkpoint callbacks, answers ``width_done`` and hands the list to its
    launcher, which stops every worker and starts one per GPU; they resume from the checkpoint."""
    TYPE: ClassVar[str] = "width"
    seq: int = _f(int, ge=1)
    gpus: list = _f(list[int], ge=0, le=1023)   # physical indices, 1 to MAX_JOB_GPUS, distinct
    reason: str = _text()

    def __post_init__(self) -> None:
        if not 1 <= len(self.gpus) <= MAX_JOB_GPUS or len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"width.gpus must hold 1 to {MAX_JOB_GPUS} distinct indices, got {self.gpus!r}")


@_dc
class WidthDone(Body):
    TYPE: ClassVar[str] = "width_done"
    seq: int = _f(int, ge=1)
    checkpoint_ms: float = _f(float, ge=0.0)   # from ``width`` arriving to the checkpoint saved


@_dc
class Checkpoint(Body):
    """Sidecar -> agent, only if its ``register.features`` has ``checkpoint``: run the job's checkpoint
    hooks at the first iteration boundary from ``at_unix`` less two iterations, answer
    ``checkpoint_done`` and train on. Sent when a sibling task of an elastic array is about to leave
    (its requeue at ``at_unix``) or has just joined: either restarts every worker from the latest
    checkpoint, and without this one it is the job's last periodic one (docs/elastic.md)."""
    TYPE: ClassVar[str] = "checkpoint"
    seq: int = _f(int, ge=1)
    at_unix: float = _f(float, ge=0.0)
    reason: str = _text()


@_dc
class CheckpointDone(Body):
    TYPE: ClassVar[str] = "checkpoint_done"
    seq: int = _f(int, ge=1)
    checkpoint_ms: float = _f(float, ge=0.0)   # the hooks' own time
    late_ms: float = _f(float)                 # the hooks' start less at_unix (negative: early, by the lead)


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
    gpus: int = _f(int, ge=1, le=MAX_JOB_GPUS)
    physical_gpus: Optional[list] = _f(list[int], nullable=True, default=None)
    account: Optional[str] = _f(str, nullable=True, default=None)  # Slurm account, for metric labels
    # The client can requeue the job when no GPU qualifies (placement "wait"); an older Prolog never
    # sends it, so it is never answered with a placement it does not know.
    may_wait: bool = _f(bool, default=False)
    # An elastic job's narrowest width (--antman-elastic=MIN:MAX; MAX is ``gpus``): the sidecar may
    # shed GPUs down to it instead of a requeue. Null: not elastic. Optional, as ``account``.
    elastic_min: Optional[int] = _f(int, ge=1, le=MAX_JOB_GPUS, nullable=True, default=None)
    # A task of an elastic job array across nodes: its array's job id (slurmctld's ArrayJobId). A GPU
    # where another task of that array runs is no room for it. Null: none. Left off the wire while
    # null, so a sidecar older than the field meets it only from such a task.
    elastic_group: Optional[str] = _job_id(nullable=True, default=None, omit_default=True)


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
    paused: bool = _f(bool, default=False)  # paused in place; optional, older sidecars: false


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
    # Paused in place by the sidecar, and why; optional: older sidecars never pause.
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


@_dc
class CheckpointNotice(Body):
    """Coordinator -> sidecar: have this job's agents checkpoint ``at_s`` seconds from now (a sibling task
    of its elastic array leaves then, or joined now); the sidecar sends ``checkpoint`` to those that
    named the feature."""
    TYPE: ClassVar[str] = "checkpoint_notice"
    job_id: str = _job_id()
    at_s: float = _f(float, ge=0.0, le=86400.0)
    reason: str = _text()


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
        Register, Registered, Report, Limits, Ack, Preempt, Pause, Paused, Resume, Resumed, Width, WidthDone,
        Checkpoint, CheckpointDone, Heartbeat, Error, Bye,
        JobRegister, JobRegisterReply, JobRetire, JobRetireReply, NodeState, NodeStateReply,
        NodeReport, NodeReportAck, JobClassUpdate, PreemptNotice, CheckpointNotice,
        QueryJobs, QueryJobsReply, QueryNodes, QueryNodesReply, QueryExplain, QueryExplainReply,
    )
}

# Which types each receiver accepts; anything else is answered with `wrong_direction`.
AGENT_TO_SIDECAR = frozenset({"register", "report", "ack", "paused", "resumed", "width_done", "checkpoint_done",
                              "heartbeat", "error", "bye"})
SIDECAR_TO_AGENT = frozenset({"registered", "limits", "preempt", "pause", "resume", "width", "checkpoint",
                              "heartbeat", "error", "bye"})
CONTROL_REQUESTS = frozenset({"job_register", "job_retire", "node_state", "heartbeat"})
CONTROL_REPLIES = frozenset({"job_register_reply", "job_retire_reply", "node_state_reply",
                             "heartbeat", "error"})
SIDECAR_TO_COORDINATOR = frozenset({"node_report", "heartbeat", "error", "bye"})
COORDINATOR_TO_SIDECAR = frozenset({"node_report_ack", "job_class_update", "preempt_notice",
                                    "checkpoint_notice", "heartbeat",
                                    "error", "bye"})
QUERY_REQUESTS = frozenset({"query_jobs", "query_nodes", "query_explain", "heartbeat"})
QUERY_REPLIES = frozenset({"query_jobs_reply", "query_nodes_reply", "query_explain_reply", "heartbeat", "error"})
