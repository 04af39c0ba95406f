"""What the policy core sees (a :class:`Snapshot`), how it is tuned (:class:`PolicyParams`) and what it
remembers between cycles (:class:`CoordinatorState`).

Everything here is a frozen value: the daemon builds a snapshot from Slurm and the sidecar reports, the
trace simulator builds one from its own model, and both hand it to ``core.decide``. Times are plain
Unix seconds chosen by the caller (the core never reads a clock), so a test or a replay is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping, Optional

from slurm_antman.policy.progress import FILL_EFFICIENCY

# Slurm states in which a job holds its allocation (and so its tenant's quota).
HOLDING_STATES = frozenset({"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STOPPED"})

REQUESTED = ("guaranteed", "opportunistic", "auto", "none")
JOB_CLASSES = ("guaranteed", "opportunistic", "none")


@dataclass(frozen=True, slots=True)
class GpuView:
    """One physical GPU as its node's sidecar last reported it."""

    index: int
    mem_total_bytes: int
    mem_used_bytes: int
    util: float  # 0..1
    guaranteed_jobs: tuple[str, ...] = ()
    opportunistic_jobs: tuple[str, ...] = ()
    # (job, fraction of its solo rate) for its opportunistic jobs whose progress the sidecar measured.
    progress: tuple[tuple[str, float], ...] = ()
    # (job, since when) for the opportunistic jobs the sidecar finds crawling (policy.moves).
    crawling: tuple[tuple[str, float], ...] = ()
    # False while a guaranteed job on it is too new for ``util`` to show it (slurm_antman.policy.node.placement).
    util_measured: bool = True


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    gpus: tuple[GpuView, ...]
    opp_slots_configured: int  # the count antman.yaml renders into slurm.conf
    opp_slots_in_slurm: int  # the count slurmctld has now (what SetOppSlots changes)
    last_report_unix: Optional[float]  # None: no sidecar heard from, the GPU figures mean nothing
    unhealthy: str = ""  # the sidecar's reason no opportunistic job may start there now; "" = healthy


@dataclass(frozen=True, slots=True)
class JobView:
    job_id: str
    account: str
    user: str
    state: str  # Slurm's: PENDING, RUNNING, COMPLETING, ...
    requested: str  # what the user asked: guaranteed | opportunistic | auto | none
    job_class: str  # current: guaranteed | opportunistic | none
    gpus: int
    node: Optional[str]
    submit_unix: float
    start_unix: Optional[float]
    restarts: int
    last_checkpoint_unix: Optional[float]
    held_for_quota: bool
    excluded_nodes: tuple[str, ...] = ()  # Slurm's ExcNodeList, expanded
    begin_wait: bool = False  # pending with Reason=BeginTime (a requeued job's ~121 s wait)
    # GRES Slurm allocated the job on each of its nodes, (node, count), for a job holding an allocation:
    # a multi-node job holds slots on every node, not only on ``node`` (its first). Empty: all ``gpus`` on ``node``.
    gpus_by_node: tuple[tuple[str, int], ...] = ()
    # A task of an elastic-across-nodes job array (docs/elastic.md, "Across nodes"): the array's id, and
    # whether this task hosts the training's rendezvous (the array's lowest index). Losing any other task
    # is a shrink: the rest train on. Losing the host ends the rendezvous, so the whole array goes.
    elastic_group: str = ""
    elastic_host: bool = False

    def allocation(self) -> tuple[tuple[str, int], ...]:
        """(node, GRES count) of every node the job holds; nothing for a job without a node."""
        if self.gpus_by_node:
            return self.gpus_by_node
        return ((self.node, self.gpus),) if self.node is not None else ()


@dataclass(frozen=True, slots=True)
class PreemptNeed:
    """A sidecar's request: guaranteed job ``job_id`` on (node, gpu) needs room that shrinking cannot free."""

    node: str
    gpu: int
    job_id: str
    reason: str
    since_unix: float
    # Set when the sidecar found this opportunistic job non-compliant: it goes, at once, whatever it loses.
    victim: str = ""


@dataclass(frozen=True, slots=True)
class Snapshot:
    now: float
    jobs: tuple[JobView, ...]
    nodes: tuple[NodeView, ...]
    quotas: Mapping[str, int]  # account -> guaranteed GPUs it may hold at once
    needs: tuple[PreemptNeed, ...] = ()


@dataclass(frozen=True, slots=True)
class PolicyParams:
    grace_s: float
    slots_per_gpu: int
    util_threshold: float
    min_opp_mem_bytes: int
    headroom_bytes: int
    queue_to_opportunistic_s: Optional[float] = None  # None: a guaranteed job over quota waits
    # Quota of an account antman.yaml lists no tenant for; None: such accounts are not limited.
    default_quota: Optional[int] = None
    # A snapshot-derived decision (class, hold, slots, upgrade) that Slurm does not reflect yet is not
    # repeated before this many seconds: the executor may simply not have been seen through yet.
    reissue_after_s: float = 60.0
    # The sidecars' slowdown target, which bounds what an opportunistic job gets beside a guaranteed one.
    target_slowdown: float = 0.02
    # A GPU takes opportunistic jobs only where one would progress at least this fraction of its solo
    # rate (policy.progress); a job under it is crawling.
    min_progress: float = 0.25
    # What opportunistic jobs fill of a guaranteed job's idle slots (policy.progress; 0: slot filling
    # off, the duty throttle's prediction alone).
    slot_fill: float = 0.0
    # A job crawling this long is moved to a GPU promising ``move_gain`` times its progress; None: never.
    move_after_s: Optional[float] = 600.0
    move_gain: float = 2.0
    # opportunistic.no_room == "wait": pending opportunistic jobs are kept off (ExcNodeList) nodes whose
    # only slot is the minimum one (policy.keep_off). The simulator models the same effect itself.
    keep_off_no_room: bool = False
    # opportunistic.upgrade_running: running opportunistic jobs become guaranteed when quota frees.
    upgrade_running: bool = True
    # sidecar.elastic_hold_s: a task an elastic array shed may start again (grow the job back) this long
    # after its requeue, not at once: the hold is the hysteresis a width change must pay for.
    elastic_hold_s: float = 300.0

    @classmethod
    def from_config(cls, cfg: Any) -> "PolicyParams":
        """From an ``AntmanConfig`` (typed loosely so the core does not import the config model)."""
        mib = 1024 * 1024
        return cls(
            grace_s=float(cfg.grace_time_s),
            slots_per_gpu=int(cfg.opportunistic.slots_per_gpu),
            util_threshold=float(cfg.opportunistic.utilization_threshold),
            min_opp_mem_bytes=int(cfg.sidecar.min_opportunistic_memory_mb) * mib,
            headroom_bytes=int(cfg.sidecar.memory_headroom_mb) * mib,
            queue_to_opportunistic_s=cfg.opportunistic.queue_to_opportunistic_s,
            target_slowdown=float(cfg.sidecar.target_slowdown),
            min_progress=float(cfg.opportunistic.min_progress),
            # Typed loosely too: a config from before slot filling has no such key.
            slot_fill=(float(getattr(cfg.sidecar, "slot_fill_efficiency", FILL_EFFICIENCY))
                       if getattr(cfg.sidecar, "slot_filling", False) else 0.0),
            move_after_s=cfg.opportunistic.move_after_s,
            move_gain=float(cfg.opportunistic.move_gain),
            keep_off_no_room=bool(cfg.sidecar.enforce) and cfg.opportunistic.no_room == "wait",
            upgrade_running=bool(cfg.opportunistic.upgrade_running),
            elastic_hold_s=float(getattr(cfg.sidecar, "elastic_hold_s", 300.0)),
        )


def quotas_from_config(cfg: Any) -> Mapping[str, int]:
    return MappingProxyType({t.account: int(t.guaranteed_gpus) for t in cfg.tenants})


@dataclass(frozen=True, slots=True)
class Preemption:
    """A notice sent to ``job_id``; at ``deadline_unix`` it is requeued unless it restarted or ended."""

    job_id: str
    node: str
    decided_unix: float
    deadline_unix: float
    restarts_at_decision: int
    reason: str
    gpu: int = -1  # the GPU of the need it answers
    for_job_id: str = ""  # the guaranteed job that needed the room


@dataclass(frozen=True, slots=True)
class Requeued:
    """A job we requeued; it gets MakeEligible when it is seen PENDING with a higher restart count, and
    again (a few times at most) if Slurm sets its BeginTime wait once more afterwards."""

    job_id: str
    node: str
    gpu: int
    for_job_id: str
    requeued_unix: float
    restarts_at_decision: int
    made_eligible: bool = False
    # When the last MakeEligible asked the job to start (its start time: now, or an elastic hold's end),
    # and how many were sent: a BeginTime wait seen well after that time is Slurm's, set again.
    eligible_unix: float = 0.0
    eligible_sent: int = 0


@dataclass(frozen=True, slots=True)
class Issued:
    """A snapshot-derived decision already emitted: ``signature`` says what, ``at_unix`` when."""

    signature: str
    at_unix: float


def _frozen(m: Mapping | None) -> Mapping:
    return MappingProxyType(dict(m or {}))


@dataclass(frozen=True, slots=True)
class Avoid:
    """Placement memory: ``job_id`` crawled on (node, gpu); its next placement avoids that GPU."""

    job_id: str
    node: str
    gpu: int
    since_unix: float


@dataclass(frozen=True, slots=True)
class KeptOff:
    """A job whose ExcNodeList the core changed; ``added``: the nodes the core put there. The rest of
    the list is the user's (or an admin's), read afresh every cycle, so a later edit of theirs is kept.
    The daemon persists these with its state; were the state file lost, what the core had added would
    read as the user's and stay until an admin clears it (``scontrol update JobId=N ExcNodeList=``)."""

    job_id: str
    added: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CoordinatorState:
    """What the core remembers between cycles. The daemon persists it (``to_json``) so that a
    restarted coordinator neither sends a notice twice nor requeues a job twice."""

    preempting: Mapping[str, Preemption] = field(default_factory=lambda: _frozen(None))
    requeued: Mapping[str, Requeued] = field(default_factory=lambda: _frozen(None))
    issued: Mapping[str, Issued] = field(default_factory=lambda: _frozen(None))
    # Placement memory of moved jobs (Avoid, set by moves.py): job -> the GPU it crawled on.
    avoid: Mapping[str, Any] = field(default_factory=lambda: _frozen(None))
    # Opportunistic jobs whose ExcNodeList the core changed (KeptOff, set by keep_off.py): job -> the nodes
    # it added, so that the rest of the list stays the user's whatever the core adds or removes.
    kept_off: Mapping[str, Any] = field(default_factory=lambda: _frozen(None))

    @classmethod
    def empty(cls) -> "CoordinatorState":
        return cls()

    def forget(self, decision: Any) -> "CoordinatorState":
        """The state as if ``decision`` had not been emitted: for the daemon when executing it failed,
        so the next cycle tries again at once."""
        kind = decision.kind
        if kind == "preempt_notice":
            return replace(self, preempting=_frozen({k: v for k, v in self.preempting.items() if k != decision.job_id}))
        if kind == "requeue":
            req = self.requeued.get(decision.job_id)
            if req is None:
                return self
            back = Preemption(req.job_id, req.node, req.requeued_unix, req.requeued_unix, req.restarts_at_decision,
                              decision.reason, req.gpu, req.for_job_id)
            return replace(
                self,
                preempting=_frozen({**self.preempting, req.job_id: back}),
                requeued=_frozen({k: v for k, v in self.requeued.items() if k != req.job_id}),
            )
        if kind == "make_eligible":
            req = self.requeued.get(decision.job_id)
            if req is None:
                return self
            return replace(self, requeued=_frozen({**self.requeued, req.job_id: replace(req, made_eligible=False)}))
        key = decision.key
        return replace(self, issued=_frozen({k: v for k, v in self.issued.items() if k != key}))

    def to_json(self) -> dict:
        return {
            "version": 1,
            "preempting": [_fields(p) for p in self.preempting.values()],
            "requeued": [_fields(r) for r in self.requeued.values()],
            "issued": {k: _fields(v) for k, v in self.issued.items()},
            "avoid": [_fields(a) for a in self.avoid.values()],
            "kept_off": [{"job_id": k.job_id, "added": list(k.added)} for k in self.kept_off.values()],
        }

    @classmethod
    def from_json(cls, data: Mapping) -> "CoordinatorState":
        """Raises ValueError naming the broken entry, so a damaged state file is reported, not guessed at."""
        if not isinstance(data, Mapping) or data.get("version") != 1:
            raise ValueError("coordinator state: expected a mapping with version 1")
        try:
            pre = [Preemption(**p) for p in data.get("preempting", [])]
            req = [Requeued(**r) for r in data.get("requeued", [])]
            iss = {str(k): Issued(**v) for k, v in dict(data.get("issued", {})).items()}
            avo = [Avoid(**a) for a in data.get("avoid", [])]
            kept = [KeptOff(str(k["job_id"]), tuple(map(str, k["added"]))) for k in data.get("kept_off", [])]
        except (TypeError, KeyError) as e:
            raise ValueError(f"coordinator state: malformed entry: {e}") from None
        return cls(
            preempting=_frozen({p.job_id: p for p in pre}),
            requeued=_frozen({r.job_id: r for r in req}),
            issued=_frozen(iss),
            avoid=_frozen({a.job_id: a for a in avo}),
            kept_off=_frozen({k.job_id: k for k in kept}),
        )


def _fields(obj: Any) -> dict:
    return {name: getattr(obj, name) for name in obj.__slots__}
