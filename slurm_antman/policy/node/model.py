"""The node policy's types: its parameters, the snapshot of a node it decides from, its state between
calls and its decision (:mod:`.core` has the rules). Pure data, shared by the sidecar and the simulator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class NodePolicyParams:
    headroom_bytes: int = 512 * MiB          # kept free on every GPU for allocator slack and contexts
    # Host memory of the node that opportunistic jobs may keep pinned for a pause (pinning.py); 0: none.
    pin_budget_bytes: int = 0
    min_opportunistic_bytes: int = 1 * GiB   # below this an opportunistic job is preempted instead
    quantum_bytes: int = 64 * MiB            # limits are rounded down to this, so noise sends no updates
    target_slowdown: float = 0.02            # guaranteed iteration time may exceed baseline by 2%
    initial_share: float = 0.5               # opportunistic budget on a GPU before any feedback
    min_share: float = 0.05
    share_step: float = 0.05                 # additive increase per report at baseline
    share_backoff: float = 0.5               # multiplicative decrease on slowdown / demand rise
    demand_rise_bytes: int = 256 * MiB       # a guaranteed demand rise this large throttles at once
    # The solo baseline is the lower median of the last this-many solo reports. Not a running mean:
    # one warm-up report (cuDNN autotuning, the allocator growing: seconds on a GPU) or a checkpoint
    # save would hold a mean above the job's real time for dozens of reports, and a baseline that is
    # too slow reads interference as a speed-up, so the loop raises the share while the guaranteed job
    # suffers (the H100 proof of 2026-11-26 read 116 ms against 72 ms alone).
    baseline_window: int = 9
    # The slowdown the loop acts on is the guaranteed job's mean over an *episode*: its reports since
    # the budget on its GPU last changed, as their total time over the total its solo time would have
    # taken (each report weighted by the iterations it covers). Not a median of single reports: an
    # opportunistic job at a low share launches its work in bursts, so most mini-batches beside it run
    # clean and a few wait behind a burst. On the contending emulated GPU a ResNet-50 read its solo time
    # in 303 of 452 reports and 1.4-2.5x it in the rest: the median of five read no slowdown, the loop
    # raised the share at every clean report, and the job ran 1.21-1.31x its work (2026-11-26;
    # docs/evaluation.md, "Why the replay's guaranteed jobs ran over their work"). A guarantee is about
    # the mean. The loop decides once an episode holds ``slowdown_window`` reports and
    # ``decide_after_s`` of the job's time (input stalls make single mini-batches vary by about 6 %,
    # three times the target: averaging is what keeps that noise from cutting the share; antman bench
    # interleave), and it raises only once the episode spans an iteration of every opportunistic
    # neighbour at its present share, so that their bursts are in it. Each change starts a new episode:
    # one decision per piece of evidence. An episode that holds the share for ``episode_max_s`` starts
    # afresh, so the mean follows phases.
    slowdown_window: int = 5
    decide_after_s: float = 2.0
    episode_max_s: float = 30.0
    # A guaranteed job that starts on a GPU where opportunistic jobs already run was never measured
    # alone, and the best time it shows beside them is no solo time: the loop then reads their
    # interference as the baseline and never cuts. The devcluster replay on the contending emulated GPU
    # showed it (two ResNet-50s started beside a neighbour ran 1.21x and 1.27x their work, those that
    # started alone 1.00x; docs/evaluation.md, "Why the replay's guaranteed jobs ran over their work",
    # 2026-11-26). So its first reports are a probe: the opportunistic jobs on its GPUs are held at
    # ``probe_share`` until it has ``baseline_window`` solo reports, or for ``probe_max_s`` at most (a
    # job that never reports must not hold them for good; 0: no probe).
    probe_share: float = 0.01
    probe_max_s: float = 60.0
    grace_s: float = 30.0                    # preemption notice to requeue
    # Over target with the budget at min_share this long: preempt the newest opportunistic job on the
    # GPU. None (the default): never, throttle only. Off by default because a requeued job is often
    # placed right back on the same GPU (docs/evaluation.md measures the churn).
    slow_preempt_s: Optional[float] = None
    # An opportunistic job progressing under this fraction of its solo rate is crawling (module doc),
    # beside a guaranteed job under crawl_below (crawl_threshold of the defaults: min_progress 0.25 and
    # the coordinator's move_gain 2).
    min_progress: float = 0.25
    crawl_below: float = 0.5
    # Pause in place instead of requeue, for jobs whose agents can (None: never pause), and for how long
    # at most before the job is requeued after all; a paused job resumes after its GPU has fitted it
    # again for resume_hold_s.
    pause_max_s: Optional[float] = None
    resume_hold_s: float = 10.0
    # Elastic jobs: the least time between two width changes of one job, except a shrink a guaranteed
    # job's claim needs (that one never waits). 300 s, as the simulator's --elastic-hold-s.
    elastic_hold_s: float = 300.0


@dataclass(frozen=True)
class GpuInfo:
    index: int
    memory_total_bytes: int
    foreign_bytes: int = 0  # used by processes slurm-antman does not manage


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    job_class: str                    # guaranteed | opportunistic
    gpus: tuple[int, ...]
    registered_unix: float
    mem_demand_bytes: int = 0         # per GPU: what the job holds or has just needed
    iteration: Optional[int] = None   # index of the last reported iteration
    iteration_ms: Optional[float] = None
    can_pause: bool = False           # every agent of the job answers pause / resume
    # Elastic width: the narrowest width (None: not elastic), the GPUs it may run on (those it was
    # placed on; ``gpus`` is the subset it runs on now), and whether it can change width now (its
    # launcher's agent is connected).
    elastic_min: Optional[int] = None
    elastic_gpus: tuple[int, ...] = ()
    can_resize: bool = False
    # The device-busy part of ``iteration_ms``, where the device measured it (CUDA events on a GPU
    # node); None elsewhere. See GuaranteedTrack.
    busy_ms: Optional[float] = None
    # A task of an elastic-across-nodes job array (its array's id; docs/elastic.md): never paused in
    # place, since every rank of its training would wait for it; its requeue is a shrink the others
    # train on through.
    elastic_group: Optional[str] = None


@dataclass(frozen=True)
class NodeSnapshot:
    gpus: tuple[GpuInfo, ...]
    jobs: tuple[JobInfo, ...]


@dataclass(frozen=True)
class GuaranteedTrack:
    solo_ms: Optional[float] = None
    best_ms: Optional[float] = None
    last_iteration: Optional[int] = None
    demand_bytes: int = 0
    solo_samples: tuple[float, ...] = ()  # the latest solo reports, oldest first (baseline_window)
    # The episode beside neighbours (NodePolicyParams.slowdown_window): its reports, the job's time
    # in them and what that time would have been alone, in ms.
    episode_reports: int = 0
    episode_ms: float = 0.0
    episode_solo_ms: float = 0.0
    # The device-busy part of the solo iterations (JobInfo.busy_ms): the lower median of the latest.
    # Beside neighbours, a report's slowdown is then its extra busy time over the solo iteration
    # time: a neighbour slows the device phase, and the input stalls around it, whose noise is most
    # of a job's variation from one mini-batch to the next, drop out.
    solo_busy_ms: Optional[float] = None
    solo_busy_samples: tuple[float, ...] = ()
    # The baseline probe (NodePolicyParams.probe_share): since when it runs, and whether it has run
    # (once per job: a probe that timed out is not begun again).
    probe_since: Optional[float] = None
    probed: bool = False

    @property
    def baseline_ms(self) -> Optional[float]:
        return self.solo_ms if self.solo_ms is not None else self.best_ms


@dataclass(frozen=True)
class PreemptRequest:
    job_id: str
    gpu: int
    reason: str
    requested_unix: float
    deadline_unix: float


@dataclass(frozen=True)
class PauseRecord:
    job_id: str
    gpu: int
    reason: str
    since_unix: float
    fits_since_unix: Optional[float] = None  # since when its GPU would fit it again


@dataclass(frozen=True)
class WidthChange:
    job_id: str
    gpus: tuple[int, ...]   # the GPUs the job runs on from now
    reason: str
    decided_unix: float

    def shed(self, before: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(g for g in before if g not in self.gpus)


@dataclass(frozen=True)
class PolicyState:
    guaranteed: Mapping[str, GuaranteedTrack] = field(default_factory=dict)
    gpu_budget: Mapping[int, float] = field(default_factory=dict)
    preempted: Mapping[str, PreemptRequest] = field(default_factory=dict)
    # GPU -> since when its guaranteed job has been over target with the budget at its floor.
    over_since: Mapping[int, float] = field(default_factory=dict)
    # Opportunistic jobs: their iteration times (solo: while nothing else ran on their GPUs).
    opportunistic: Mapping[str, GuaranteedTrack] = field(default_factory=dict)
    # Opportunistic job -> since when it has been crawling.
    crawling: Mapping[str, float] = field(default_factory=dict)
    # Opportunistic jobs paused in place.
    paused: Mapping[str, PauseRecord] = field(default_factory=dict)
    # Elastic jobs: when each last changed width (the hold counts from there).
    width_changed: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class JobLimits:
    mem_limit_bytes: Optional[int]
    compute_share: float
    pin_bytes: int = 0  # host memory it may keep pinned for a pause (pinning.pin_grants)


UNLIMITED = JobLimits(None, 1.0)


@dataclass(frozen=True)
class Decision:
    limits: Mapping[str, JobLimits]
    new_preemptions: tuple[PreemptRequest, ...]
    state: PolicyState
    slowdown: Mapping[str, float]  # guaranteed job -> latest measured slowdown, for display
    # Opportunistic job -> its progress, the fraction of its solo rate it makes (when measured).
    progress: Mapping[str, float] = field(default_factory=dict)
    new_pauses: tuple[PauseRecord, ...] = ()
    resumes: tuple[str, ...] = ()  # jobs to resume: their GPU fits them again
    width_changes: tuple[WidthChange, ...] = ()
