"""What the simulator keeps of each job and each GPU while it runs, its event kinds, and its result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from slurm_antman.policy import cluster as cp
from slurm_antman.policy.node import core as lp

from ..traces import TraceJob
from ..workloads import Profile

# Event kinds, in the order they are handled at one instant: finishes free GPUs before new jobs look.
FINISH, SUBMIT, WAKE, CYCLE, SLOW, REQUEUE, MEASURED, PAUSE_CHECK = 0, 1, 2, 3, 4, 5, 6, 7


@dataclass(slots=True)
class SimJob:
    """A trace job's life in the simulator, across its restarts."""

    job: TraceJob
    profile: Profile
    requested: str
    klass: str
    submit: float
    duration: float
    state: str = "PENDING"
    held: bool = False
    gpus: list[int] = field(default_factory=list)
    work_left: float = 0.0
    rate: float = 0.0
    t_last: float = 0.0
    version: int = 0
    first_start: Optional[float] = None
    start: Optional[float] = None
    end: Optional[float] = None
    restarts: int = 0
    preemptions: int = 0
    ooms: int = 0
    lost_gpu_s: float = 0.0
    eligible_at: float = 0.0
    ran_as: str = ""
    view: Optional[cp.JobView] = None
    notice_at: Optional[float] = None
    submitted_as: str = ""  # the class job_submit.lua gave it: what the guaranteed-JCT target is about
    util: float = 1.0       # mean GPU utilisation alone (utilisation.py)
    duty: float = 1.0       # its fraction of the benchmark's GPU work (Profile.duty)
    avoid: tuple[int, ...] = ()  # antman's placement memory: GPUs it was moved off
    finishes: int = 0
    ticket: int = 0   # its current entry in the queue
    queued_at: float = 0.0  # when it last entered the queue (the switch wait counts from there)
    locality: float = 1.0   # its placement's per-GPU efficiency (1.0 on one node; config.locality)
    elastic: bool = False   # opportunistic under antman: may run on 1 to job.gpus GPUs (elastic.py)
    width_changed_at: float = 0.0
    width_changes: int = 0
    off: list[int] = field(default_factory=list)  # elastic: GPUs it shed, whose Slurm slots it keeps
    # Elastic across nodes, a job array (elastic_array.py). On a task: its trace job's id and its index.
    # On the trace job: its tasks, those its training runs on, when its training last (re)started from a
    # checkpoint, and since when its idle tasks' GPU-seconds are counted.
    array: Optional[str] = None
    task: int = -1
    tasks: list[str] = field(default_factory=list)
    train: list[str] = field(default_factory=list)
    ckpt_from: float = 0.0
    ckpt_at: Optional[float] = None  # when a checkpoint_notice's checkpoint is (or was) taken
    idle_from: float = 0.0


@dataclass(slots=True)
class SimGpu:
    """One simulated GPU: who is on it, and the rates, load and memory the model gives them."""

    index: int
    node: int
    local: int
    mem_total: int
    guar: list[str] = field(default_factory=list)
    opp: list[str] = field(default_factory=list)
    rate: dict[str, float] = field(default_factory=dict)
    share: dict[str, float] = field(default_factory=dict)
    util: float = 0.0
    mem_used: int = 0
    lp_state: lp.PolicyState = field(default_factory=lp.PolicyState)
    need: Optional[cp.PreemptNeed] = None
    # Since when its guaranteed job has been over target with its neighbours at the minimum share
    # (the local policy's slow_preempt_s rule), as the steady state of this mix says.
    slow_since: Optional[float] = None
    useful: float = 0.0  # progress-weighted busy time: sum of each job's rate x its own utilisation
    # antman: until when the sidecar's window does not show its newest guaranteed job yet (its
    # start-up plus a window of iterations): no opportunistic room before (slurm_antman.policy.node.placement).
    measured_at: float = 0.0
    progress: dict[str, float] = field(default_factory=dict)  # opportunistic job -> its rate
    crawl: dict[str, float] = field(default_factory=dict)     # opportunistic job -> crawling since


@dataclass(frozen=True, slots=True)
class Reservation:
    """Backfill's plan for the first whole-GPU job that cannot start: from ``start`` on it holds
    ``count[node]`` GPUs of each node; a later job may use them only if it ends before."""

    job_id: str
    start: float
    count: dict[int, int]


@dataclass
class SimResult:
    policy: str
    metrics: dict
    jobs: list[dict]
    series: list[tuple[float, float, float]]  # (time s, sm_util, mem_util)

