"""A discrete-event replay of a trace on a simulated GPU cluster, under the policies a Slurm site
would choose between (docs/evaluation.md):

- ``exclusive``: plain Slurm, one job per GPU, FIFO with backfill-lite (any pending job that fits
  starts, in submission order).
- ``quota``: whole GPUs, each tenant limited to its quota of GPUs at once (``sacctmgr ... set
  GrpTRES=gres/gpu=N``); a job over its tenant's quota waits. A job larger than its tenant's whole
  quota runs when the tenant has nothing else running (Slurm would hold it forever; a site sets the
  quota at least its largest job).
- ``scavenger``: Slurm's native preemption. A job within its tenant's quota at submission goes to the
  high partition (quota-limited as above), any other to a preemptible scavenger partition that runs
  on idle whole GPUs (``PreemptType=preempt/partition_prio``, ``PreemptMode=REQUEUE``). A high job
  that finds too few idle GPUs has scavenger jobs preempted (the youngest first): a signal, the grace
  time, a requeue; the requeued job waits ``requeue_delay_s`` (Slurm's BeginTime) and restarts from
  its checkpoint.
- ``shared``: opportunistic jobs packed onto GPUs beside others with no control (gres/shard today):
  every job on a GPU slows by the workload model's interference; a GPU whose footprints exceed its
  memory makes the job that arrived last fail with OOM (counted, retried after ``oom_retry_s``).
- ``antman``: the production policy code. The cluster policy core (``slurm_antman.policy.cluster.decide``)
  resolves classes by tenant quota, sets each node's opportunistic slot count, upgrades and preempts;
  the node-local policy (``slurm_antman.policy.node.core.decide``) sets memory limits, compute shares and
  raises preemption needs; ``slurm_antman.policy.node.placement.choose_gpus`` picks the GPU of an opportunistic job.

Which jobs are opportunistic: a Philly job is submitted ``auto`` and resolved at submission, as
job_submit.lua does: guaranteed when its tenant's (virtual cluster's) GPUs in the quota file plus its
own fit the tenant's quota, else opportunistic. The quota file is rewritten once per cycle (so it can
be a cycle old) under every policy. A tenant's quota is its share of the window's GPU-time times the
cluster size times ``quota_scale``. An openb pod of qos BE asks for opportunistic, every other pod for
guaranteed, with no quotas. ``exclusive`` tags jobs the same way (for the guaranteed-JCT metric) but
runs every job alone on its GPUs. A pending job keeps the class it was submitted with: Slurm 22.05
schedules it by its original GRES (docs/architecture.md), so a coordinator ``SetClass`` on a pending
job only releases its hold.

Speed: at most one coordinator cycle per batch of events at one instant and per ``cycle_s``; a cycle
sees only active jobs, with running guaranteed jobs summed per tenant (docs/evaluation.md).

The compute share an opportunistic job gets under antman is the steady state of the local policy's
AIMD loop, found by running ``local_policy.decide`` on the modelled iteration times of the GPU's
guaranteed job (cached per combination of profiles: the loop converges in seconds, jobs run for
minutes to days). See docs/workload_model.md for the formulas.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from typing import Collection, Iterable, Iterator, Mapping, Optional, Sequence

from slurm_antman.policy.node import core as lp
from slurm_antman.policy.node.placement import GpuLoad, choose_gpus
from slurm_antman.policy import cluster as cp
from slurm_antman.policy.cluster.quota import fits_quota

from . import utilisation
from .traces import Job
from .workloads import GiB, Profile, assign

POLICIES = ("exclusive", "quota", "scavenger", "shared", "antman")
NO_ROOM = ("fallback", "wait")
# Policies under which every job holds whole GPUs alone.
WHOLE_GPU = frozenset({"exclusive", "quota", "scavenger"})

# Event kinds, in the order they are handled at one instant: finishes free GPUs before new jobs look.
_FINISH, _SUBMIT, _WAKE, _CYCLE, _SLOW, _REQUEUE, _MEASURED, _PAUSE_CHECK = 0, 1, 2, 3, 4, 5, 6, 7

SPILL_RATE = 0.5  # opportunistic job whose memory limit is under its footprint (estimate, see docs)

# The AIMD loop's steady state (``Simulator._steady_shares``) is a smooth function of the interference
# coefficient c, which production utilisation makes continuous: each distinct c cost 120 runs of the
# local policy and took a third of antman's simulation time. c is taken on a logarithmic grid of 5 %
# steps (within 2.5 % of the true c; the steady share is a staircase in c that halves with the AIMD
# decrease), and the steady states are kept for the process: a run needs a few hundred of them.
_C_STEP = 0.05
_C_MIN = 1e-4  # below: no measurable interference
_SHARE_CACHE: dict[tuple, tuple[float, bool]] = {}


def _c_grid(c: float) -> float:
    if c < _C_MIN:
        return 0.0
    return math.exp(round(math.log(c) / _C_STEP) * _C_STEP)


@dataclass(frozen=True)
class SimConfig:
    policy: str = "antman"
    nodes: int = 4
    gpus_per_node: int = 8
    gpu_mem_bytes: int = 32 * GiB
    speedup: float = 1.0          # every trace time divided by this
    quota_scale: float = 1.0
    slots_per_gpu: int = 2
    util_threshold: float = 0.8
    # opportunistic.utilization_window_s: the sidecar's utilisation average, and how long a new
    # guaranteed job must have iterated before its GPU counts as measured (slurm_antman.policy.node.placement).
    util_window_s: float = 10.0
    # antman: pause in place before requeue (sidecar.pause_max_s; None: requeue at once, as before
    # issue 16), its resume hold (sidecar.resume_hold_s), and the cost of one pause and resume: the
    # job's GPU memory over this bandwidth, each way, lost from its progress. 12e9 B/s: PCIe 3.0 x16
    # (15.75 GB/s raw, the bus of PipeSwitch's testbed, OSDI'20 section 6) at the ~75 % pinned copies
    # reach; `antman bench gpu` part 7 measures this on the lent GPU nodes.
    pause_max_s: Optional[float] = None
    resume_hold_s: float = 10.0
    pause_bandwidth_bytes_s: float = 12e9
    grace_s: float = 30.0
    checkpoint_s: float = 1800.0  # opportunistic jobs checkpoint this often (estimate)
    oom_retry_s: float = 60.0
    seed: int = 0
    max_samples: int = 2000       # points kept for the utilisation-over-time plot
    # The coordinator loop: at most one cycle per batch of events at one instant, and at least this
    # many simulated seconds between cycles (the daemon's loop is ~1 s; jobs last minutes to days, and
    # docs/evaluation.md shows 5, 30 and 60 s give the same results within 3 %).
    # The quota file job_submit.lua reads is rewritten at the same pace, under every policy.
    cycle_s: float = 30.0
    # torch_patch's agent runs the job's on_preempt hook at the notice: the job saves then and loses
    # only what it computes during the grace time. False: it loses the work since its last periodic
    # checkpoint (a job that registered no hook).
    checkpoint_on_notice: bool = True
    # Seconds from a job's start to its first progress, added to every (re)start. 0 for trace-scale
    # runs (minutes to days of work); the devcluster replay's emulated jobs spend a few seconds
    # starting Python and torch, which ``antman bench trace --with-simulator`` measures and passes.
    start_overhead_s: float = 0.0
    # The local policy's preemption for speed (``sidecar.slow_preempt_s``); None: throttle only.
    slow_preempt_s: Optional[float] = lp.PolicyParams.slow_preempt_s
    # How busy jobs keep their GPUs (utilisation.py): production (drawn from published cluster
    # figures) or saturated (every job as busy as its benchmark).
    utilisation: str = "production"
    # production: every drawn utilisation times this (capped at the benchmark's), for the sweep of
    # docs/evaluation.md: where sharing pays and where it breaks even.
    util_scale: float = 1.0
    # scavenger: a requeued job is not eligible before this (Slurm's BeginTime after a requeue,
    # ~121 s on 22.05, docs/architecture.md); antman clears it with MakeEligible.
    requeue_delay_s: float = 120.0
    # antman: opportunistic.min_progress, move_after_s, move_gain (antman.yaml).
    min_progress: float = cp.PolicyParams.__dataclass_fields__["min_progress"].default
    move_after_s: Optional[float] = cp.PolicyParams.__dataclass_fields__["move_after_s"].default
    move_gain: float = cp.PolicyParams.__dataclass_fields__["move_gain"].default
    # antman: what an opportunistic job does on a node where fewer GPUs than it asks meet the
    # opportunistic rules (antman.yaml opportunistic.no_room). wait (the default): it waits for room
    # (``choose_gpus(wait_without_room=True)``; the daemons requeue it from its Prolog and keep it off
    # such nodes, policy.keep_off, which the simulator models as nothing starting there); fallback: it
    # starts on the least-loaded GPUs.
    no_room: str = "wait"
    # antman: opportunistic.upgrade_running (off by default, as in antman.yaml).
    upgrade_running: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--policy {self.policy!r} is not allowed; allowed: {', '.join(POLICIES)}")
        for name in ("nodes", "gpus_per_node", "slots_per_gpu"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.speedup > 0:
            raise ValueError(f"--speedup must be > 0, got {self.speedup}")
        from .workloads import MIN_GPU_MEMORY_BYTES
        if self.gpu_mem_bytes < MIN_GPU_MEMORY_BYTES:
            raise ValueError(f"--gpu-mem-gib must be >= {MIN_GPU_MEMORY_BYTES / GiB:g}: every profile of the "
                             "workload model must fit a GPU alone")
        if self.quota_scale < 0:
            raise ValueError(f"quota_scale must be >= 0, got {self.quota_scale}")
        if not self.cycle_s >= 0:
            raise ValueError(f"--cycle-s must be >= 0, got {self.cycle_s}")
        if self.slow_preempt_s is not None and not self.slow_preempt_s > 0:
            raise ValueError(f"--slow-preempt-s must be > 0 (or 'none'), got {self.slow_preempt_s}")
        utilisation.check_mode(self.utilisation)
        if not self.util_scale > 0:
            raise ValueError(f"--util-scale must be > 0, got {self.util_scale}")
        if not 0 < self.min_progress <= 1:
            raise ValueError(f"--min-progress must be in (0, 1], got {self.min_progress}")
        if self.move_after_s is not None and not self.move_after_s > 0:
            raise ValueError(f"--move-after-s must be > 0 (or 'none'), got {self.move_after_s}")
        if not self.move_gain >= 1:
            raise ValueError(f"--move-gain must be >= 1, got {self.move_gain}")
        if self.no_room not in NO_ROOM:
            raise ValueError(f"--no-room {self.no_room!r} is not allowed; allowed: {', '.join(NO_ROOM)}")
        if not self.requeue_delay_s >= 0:
            raise ValueError(f"requeue_delay_s must be >= 0, got {self.requeue_delay_s}")


@dataclass(slots=True)
class _Job:
    job: Job
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


@dataclass(slots=True)
class _Gpu:
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
class _Jobs:
    """The one field of a snapshot the coordinator's quota-file writer reads."""

    jobs: tuple[cp.JobView, ...]


@dataclass
class SimResult:
    policy: str
    metrics: dict
    jobs: list[dict]
    series: list[tuple[float, float, float]]  # (time s, sm_util, mem_util)


class Simulator:
    def __init__(self, jobs: Sequence[Job], cfg: SimConfig):
        self.cfg = cfg
        n = cfg.nodes * cfg.gpus_per_node
        self.gpus = [_Gpu(i, i // cfg.gpus_per_node, i % cfg.gpus_per_node, cfg.gpu_mem_bytes) for i in range(n)]
        self.node_names = [f"sim{k:04d}" for k in range(cfg.nodes)]
        self.node_index = {name: k for k, name in enumerate(self.node_names)}
        self.opp_slots = [cfg.slots_per_gpu * cfg.gpus_per_node] * cfg.nodes
        self.node_opp = [0] * cfg.nodes  # opportunistic slots in use per node (kept for _place)
        # Nodes whose count the coordinator keeps at the minimum with no GPU that qualifies (a slot
        # only so that slurmctld accepts submissions): under no_room=wait nothing starts there.
        self.no_room_nodes: set[int] = set()
        # Under no_room=wait, nodes where no GPU met the opportunistic rules at the last try, until
        # one of their GPUs changes (_refresh): any other job would find none there either.
        self.unfit_nodes: set[int] = set()
        self.jobs: dict[str, _Job] = {}
        # The queue, one per (scavenger's high partition?, tenant, GPUs asked), each in submission
        # order (a requeued job at the end): (job, ticket) entries, of which only the one with the
        # job's current ticket counts. Split so that a pass skips at once the jobs that their tenant's
        # quota keeps waiting, instead of stepping over thousands of them (``_in_order``).
        self.queues: dict[tuple[bool, str, int], list[tuple[str, int]]] = {}
        self.heads: dict[tuple[bool, str, int], int] = {}  # per queue: entries before it have all left
        self.dead: dict[tuple[bool, str, int], int] = {}   # per queue: entries that left it
        self.heap: list[tuple] = []
        self.seq = 0
        self.now = 0.0
        self.quotas = self._quotas(jobs)
        self.cp_params = cp.PolicyParams(
            grace_s=cfg.grace_s, slots_per_gpu=cfg.slots_per_gpu, util_threshold=cfg.util_threshold,
            min_opp_mem_bytes=lp.PolicyParams().min_opportunistic_bytes,
            headroom_bytes=lp.PolicyParams().headroom_bytes, queue_to_opportunistic_s=None)
        self.cp_params = replace(self.cp_params, min_progress=cfg.min_progress, move_after_s=cfg.move_after_s,
                                 move_gain=cfg.move_gain, upgrade_running=cfg.upgrade_running)
        self.lp_params = lp.PolicyParams(grace_s=cfg.grace_s, slow_preempt_s=cfg.slow_preempt_s,
                                         min_progress=cfg.min_progress, pause_max_s=cfg.pause_max_s,
                                         resume_hold_s=cfg.resume_hold_s)
        self.cp_state = cp.CoordinatorState.empty()
        self.dirty_nodes: set[int] = set(range(cfg.nodes))
        self.gpu_views: dict[int, tuple[cp.GpuView, ...]] = {}  # per node, while it is not dirty
        self.slow_gpus: set[int] = set()
        self.util_sum = 0.0
        self.mem_sum = 0
        self.t_int = 0.0
        self.area_util = 0.0
        self.area_mem = 0.0
        self.area_util_all = 0.0  # over [first submission, last completion] (the makespan)
        self.area_mem_all = 0.0
        self.useful_sum = 0.0
        self.area_useful = 0.0
        self.area_useful_queued = 0.0  # while a job waits: the capacity question
        self.t_queued = 0.0
        self.n_pending = 0
        self.tenant_gpus: dict[str, int] = {}   # tenant -> GPUs its running jobs hold (any class)
        self.high_gpus: dict[str, int] = {}     # scavenger: tenant -> GPUs of its high-partition jobs
        self.crawl_gpus: set[int] = set()       # antman: GPUs with a crawling opportunistic job
        self.fresh: list[tuple[str, int]] = []   # queued since the last scheduling pass
        self.guaranteed_use: dict[str, int] = {}  # tenant -> GPUs of its guaranteed jobs not done
        self.sched_dirty = True                  # GPUs, quota or eligibility freed since then
        self.series: list[tuple[float, float, float]] = []
        # Kept up to date so a scheduling pass over a long queue costs little per job.
        self.free_gpus: set[int] = set(range(n))      # no guaranteed job (exclusive: no job at all)
        self.usage: dict[str, int] = {}               # tenant -> GPUs running as guaranteed
        self.counts = {"oom_failures": 0, "preemptions": 0, "upgrades": 0, "cycles": 0,
                       "set_class_ineffective": 0, "moves": 0, "quota_over_alone": 0, "pauses": 0, "resumes": 0}
        self.paused_s = 0.0      # job-seconds spent paused in place (ended pauses)
        self.pause_cost_s = 0.0  # progress lost moving state out and back
        # Jobs that are PENDING or RUNNING, in submission order: what a cycle looks at (not all jobs).
        self.active: dict[str, _Job] = {}
        # What job_submit.lua reads (antman_quota.lua): guaranteed GPUs each tenant holds or is about
        # to hold, as the coordinator last wrote it.
        self.quota_file: dict[str, int] = {}
        self.last_cycle: Optional[float] = None
        self.changed = True          # something happened since the last cycle
        self.cycle_queued = False    # a _CYCLE event is in the heap
        self.force_cycle = False     # run the next cycle even if the last was under cycle_s ago
        starts = [j.submit_s for j in jobs]
        self.t0 = min(starts) / cfg.speedup if starts else 0.0
        self.t_end_measure = max(starts) / cfg.speedup if starts else 0.0
        for j in jobs:
            self._add(j)

    # -- setup ----------------------------------------------------------------------------------

    def _quotas(self, jobs: Sequence[Job]) -> Mapping[str, int]:
        return tenant_quotas(jobs, len(self.gpus), self.cfg.quota_scale)

    def _add(self, j: Job) -> None:
        requested = ("opportunistic" if j.qos == "BE" else "guaranteed") if j.qos is not None else "auto"
        prof = assign(j.job_id, self.cfg.seed)
        submit = j.submit_s / self.cfg.speedup
        dur = max(j.duration_s / self.cfg.speedup, 1e-3)
        klass = "opportunistic" if requested == "opportunistic" else "guaranteed"
        if self.cfg.utilisation == "saturated":
            util = prof.sm_util
        else:  # an openb pod list carries qos: Alibaba PAI's figures; Philly's otherwise
            util = self.cfg.util_scale * utilisation.draw(j.job_id, j.gpus, "pai" if j.qos is not None else "philly",
                                                          self.cfg.seed)
        duty = prof.duty(util)
        sj = _Job(j, prof, requested, klass, submit, dur, work_left=dur, submitted_as=klass,
                  util=duty * prof.sm_util, duty=duty)
        self.jobs[j.job_id] = sj
        self._push(submit, _SUBMIT, j.job_id, 0)

    def _push(self, t: float, kind: int, jid: str, version: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, jid, version))

    # -- the event loop -------------------------------------------------------------------------

    def run(self) -> SimResult:
        while self.heap:
            t = self.heap[0][0]
            self._integrate(t)
            self.now = t
            while self.heap and self.heap[0][0] == t:
                _, kind, _, jid, version = heapq.heappop(self.heap)
                if kind == _CYCLE:
                    self.cycle_queued = False
                    continue
                j = self.jobs[jid]
                if kind == _SUBMIT:
                    self._submit(j)
                elif kind == _FINISH:
                    if j.state != "RUNNING" or version != j.version:
                        continue  # a stale finish time: the job's rate changed since
                    self._finish(j)
                elif kind == _WAKE:
                    self.sched_dirty = True  # a job's retry or BeginTime is over
                    self.force_cycle = True  # a grace time is over: requeue now, not a cycle later
                elif kind == _MEASURED:  # a new guaranteed job now shows in its GPU's utilisation
                    g = self.gpus[version]
                    if self.now >= g.measured_at:
                        self.dirty_nodes.add(g.node)
                        self.unfit_nodes.discard(g.node)
                        self.sched_dirty = True
                elif kind == _PAUSE_CHECK:  # a paused job's hold or pause budget may be over
                    g = self.gpus[version]
                    if g.lp_state.paused:
                        self._refresh([version])
                        self.changed = True
                elif kind == _REQUEUE:  # scavenger: Slurm requeues a preempted job after its grace time
                    if j.state == "RUNNING" and version == j.restarts and j.notice_at is not None:
                        self._stop(j, "preempt")
                # _SLOW (a GPU's slow_preempt_s is over): only a change, handled at the next due cycle
                self.changed = True
            self._maybe_cycle()
            self._schedule()
        self._integrate(self.now)
        return self._result()

    def _maybe_cycle(self) -> None:
        """One coordinator cycle (antman) or quota-file rewrite (all policies) for this batch of
        events, unless one ran less than ``cycle_s`` ago: then one is queued for when it may run."""
        if not self.changed:
            return
        due = self.last_cycle is None or self.now - self.last_cycle >= self.cfg.cycle_s or self.force_cycle
        if not due:
            if not self.cycle_queued:
                self.cycle_queued = True
                self._push(self.last_cycle + self.cfg.cycle_s, _CYCLE, "", 0)
            return
        self.last_cycle, self.changed, self.force_cycle = self.now, False, False
        if self.cfg.policy == "antman":
            self._cycle()
        else:
            # Without a coordinator nothing is held and a class never changes after submission, so
            # what quota_use counts (guaranteed jobs running or pending) is kept as jobs come and go.
            self.quota_file = {t: n for t, n in self.guaranteed_use.items() if n}

    @staticmethod
    def _quota_use(views: Iterable[cp.JobView]) -> dict[str, int]:
        from slurm_antman.coordinator.daemon import quota_use
        return quota_use(_Jobs(tuple(views)))

    def _submit(self, j: _Job) -> None:
        """job_submit.lua: ``auto`` becomes guaranteed when the tenant's GPUs in the quota file plus
        this job's fit its quota, opportunistic otherwise (no quota entry: the site's auto_class,
        guaranteed). The file can be a cycle old, as on the real cluster."""
        jid = j.job.job_id
        self.active[jid] = j
        self.n_pending += 1
        if j.requested == "auto":
            q = self.quotas.get(j.job.tenant)
            within = fits_quota(q, self.quota_file.get(j.job.tenant, 0), j.job.gpus)
            j.klass = j.submitted_as = "guaranteed" if within else "opportunistic"
        self._enqueue(j)  # into its partition's queue: the class decides which
        self._count_guaranteed(j, +1)

    def _enqueue(self, j: _Job) -> None:
        self.seq += 1
        j.ticket = self.seq
        entry = (j.job.job_id, j.ticket)
        self.queues.setdefault(self._queue_key(j), []).append(entry)
        self.fresh.append(entry)

    def _queue_key(self, j: _Job) -> tuple[bool, str, int]:
        return self.cfg.policy == "scavenger" and self._is_high(j), j.job.tenant, j.job.gpus

    def _queued(self, entry: tuple[str, int]) -> bool:
        j = self.jobs[entry[0]]
        return j.ticket == entry[1] and j.state == "PENDING"

    def _count_guaranteed(self, j: _Job, sign: int) -> None:
        if j.klass == "guaranteed":
            t = j.job.tenant
            self.guaranteed_use[t] = self.guaranteed_use.get(t, 0) + sign * j.job.gpus

    def _integrate(self, t: float) -> None:
        lo, hi = max(self.t_int, self.t0), min(t, self.t_end_measure)
        if hi > lo:
            self.area_util += self.util_sum * (hi - lo)
            self.area_mem += self.mem_sum * (hi - lo)
            self.area_useful += self.useful_sum * (hi - lo)
        if t > self.t_int and self.n_pending > 0:
            self.area_useful_queued += self.useful_sum * (t - self.t_int)
            self.t_queued += t - self.t_int
        if t > lo:
            self.area_util_all += self.util_sum * (t - lo)
            self.area_mem_all += self.mem_sum * (t - lo)
        if t > self.t_int:
            n = len(self.gpus)
            self.series.append((self.t_int, self.util_sum / n, self.mem_sum / (n * self.cfg.gpu_mem_bytes)))
        self.t_int = t

    # -- job lifecycle --------------------------------------------------------------------------

    def _schedule(self) -> None:
        """One scheduling pass over the queue. A pass costs the length of the queue, which under a
        quota or a busy scavenger partition holds thousands of jobs, so passes that cannot start
        anything are skipped: a whole-GPU policy with no idle GPU starts nothing."""
        fresh, self.fresh = self.fresh, []
        if not self.n_pending:
            return
        policy = self.cfg.policy
        # Under whole GPUs a queued job can start only once GPUs, quota or its eligibility free up:
        # until then, only the jobs submitted since the last pass are worth looking at.
        only_fresh = policy in WHOLE_GPU and not self.sched_dirty
        if policy in WHOLE_GPU:
            self.sched_dirty = False

        def queue(high: Optional[bool]) -> Iterable[tuple[str, int]]:
            if only_fresh:
                return [e for e in fresh if self._queued(e)
                        and (high is None or self._is_high(self.jobs[e[0]]) == high)]
            return self._in_order(high)

        if policy != "scavenger":
            if policy not in WHOLE_GPU or self.free_gpus:
                self._schedule_pass(queue(None))
            return
        # Slurm schedules the higher-priority partition first, and preempts for what is left of it.
        if self.free_gpus:
            self._schedule_pass(queue(True))
        # Preemption weighs every waiting high job: those already waiting claim the GPUs being freed,
        # and the idle GPUs they wait to gather are theirs: the scavenger partition gets what is left
        # (a GPU freed for a waiting 8-GPU job is not handed to a scavenger job, which it would only
        # preempt again).
        spare = self._preempt_scavengers(self._in_order(True))
        if spare > 0:
            self._schedule_pass(queue(False), budget=spare)

    def _in_order(self, high: Optional[bool]) -> Iterator[tuple[str, int]]:
        """The queued entries of one partition (None: both) in submission order, merged from the
        per-tenant, per-size queues. A queue is left out, or dropped the moment a start in this very
        pass gets its tenant there, when the tenant's quota has no room for its size: a pass then
        costs the jobs that could start, not the thousands that wait for their tenant's quota.
        Entries that left a queue are stepped over once at its front and compacted away when they
        are half of it."""
        heap = []
        for key, q in self.queues.items():
            if high is not None and key[0] != high:
                continue
            if self.dead.get(key, 0) * 2 > len(q):
                q = self.queues[key] = [e for e in q if self._queued(e)]
                self.dead[key] = self.heads[key] = 0
            h = self.heads.get(key, 0)
            while h < len(q) and not self._queued(q[h]):
                h += 1
            self.heads[key] = h
            if h < len(q) and not self._at_quota(key):
                heap.append((q[h][1], key, h))
        heapq.heapify(heap)
        while heap:
            _, key, i = heapq.heappop(heap)
            q = self.queues[key]
            yield q[i]
            # Only the tenant whose job was just looked at can have reached its quota since.
            if i + 1 < len(q) and not self._at_quota(key):
                heapq.heappush(heap, (q[i + 1][1], key, i + 1))

    def _at_quota(self, key: tuple[bool, str, int]) -> bool:
        """No job of this queue can be within its tenant's quota (``_within_quota``): the tenant
        holds GPUs (in this partition) and this many more do not fit."""
        policy = self.cfg.policy
        if policy == "quota":
            held = self.tenant_gpus
        elif policy == "scavenger" and key[0]:
            held = self.high_gpus
        else:
            return False
        have = held.get(key[1], 0)
        return have > 0 and not fits_quota(self.quotas.get(key[1]), have, key[2])

    def _is_high(self, j: _Job) -> bool:
        return j.submitted_as == "guaranteed"

    def _within_quota(self, j: _Job) -> bool:
        """quota, and scavenger's high partition: the tenant's GPUs held plus this job's fit its
        quota; a job larger than the whole quota runs when the tenant holds nothing (module doc)."""
        policy = self.cfg.policy
        if policy == "quota":
            held = self.tenant_gpus
        elif policy == "scavenger" and self._is_high(j):
            held = self.high_gpus
        else:
            return True
        q = self.quotas.get(j.job.tenant)
        have = held.get(j.job.tenant, 0)
        if fits_quota(q, have, j.job.gpus):
            return True
        return have == 0 and q is not None and j.job.gpus > q

    def _schedule_pass(self, ids: Iterable[tuple[str, int]], budget: Optional[int] = None) -> None:
        """Start what fits, in queue order; ``budget``: at most this many GPUs in all."""
        whole = self.cfg.policy in WHOLE_GPU
        # Nothing changes between placements, so a job no smaller than one that did not fit cannot fit;
        # likewise per tenant for its quota (its GPUs only grow during a pass).
        smallest_failed = {"guaranteed": 1 << 30, "opportunistic": 1 << 30}
        over_quota: dict[str, int] = {}
        for jid, ticket in ids:
            j = self.jobs[jid]
            if j.state != "PENDING" or j.ticket != ticket or j.held or j.eligible_at > self.now:
                continue
            tenant = j.job.tenant
            if j.job.gpus >= over_quota.get(tenant, 1 << 30):
                continue
            if not self._within_quota(j):
                over_quota[tenant] = min(over_quota.get(tenant, 1 << 30), j.job.gpus)
                continue
            if budget is not None and j.job.gpus > budget:
                if budget <= 0:
                    break
                continue
            kind = "guaranteed" if j.klass == "guaranteed" or whole else "opportunistic"
            gpus = None if j.job.gpus >= smallest_failed[kind] else self._place(j)
            if gpus is None:
                smallest_failed[kind] = min(smallest_failed[kind], j.job.gpus)
                if smallest_failed["guaranteed"] <= 1 and (whole or smallest_failed["opportunistic"] <= 1):
                    break  # not even a 1-GPU job fits: the rest waits
                continue
            smallest_failed = {"guaranteed": 1 << 30, "opportunistic": 1 << 30}
            self._start(j, gpus)
            if budget is not None:
                budget -= len(gpus)

    def _preempt_scavengers(self, high: Iterable[tuple[str, int]]) -> int:
        """Slurm's preempt/partition_prio: a high job that is eligible and within quota but finds too
        few idle GPUs has scavenger jobs signalled (the youngest first, so the least work is lost);
        they are requeued when the grace time is over (``_REQUEUE``). GPUs already being freed count.
        Returns how many idle GPUs no waiting high job claims."""
        free = len(self.free_gpus)
        freeing: Optional[int] = None  # counted at the first job that needs more than is idle
        victims: Optional[list[_Job]] = None
        for jid, ticket in high:
            j = self.jobs[jid]
            if (j.state != "PENDING" or j.ticket != ticket or j.held or j.eligible_at > self.now
                    or not self._within_quota(j)):
                continue
            deficit = j.job.gpus - free
            free = max(0, free - j.job.gpus)
            if deficit <= 0:
                continue
            if freeing is None:
                freeing = sum(len(x.gpus) for x in self.active.values()
                              if x.state == "RUNNING" and x.notice_at is not None)
            cover = min(deficit, freeing)
            deficit, freeing = deficit - cover, freeing - cover
            if victims is None:
                victims = sorted((x for x in self.active.values()
                                  if x.state == "RUNNING" and x.notice_at is None and not self._is_high(x)),
                                 key=lambda x: (x.start or 0.0, x.job.job_id))
            while deficit > 0 and victims:
                v = victims.pop()
                v.notice_at = self.now
                self._push(self.now + self.cfg.grace_s, _REQUEUE, v.job.job_id, v.restarts)
                deficit -= len(v.gpus)
            freeing += max(0, -deficit)
            if deficit > 0:
                return 0  # nothing left to preempt
        return free

    def _place(self, j: _Job) -> Optional[list[int]]:
        want = j.job.gpus
        if j.klass == "guaranteed" or self.cfg.policy in WHOLE_GPU:
            if len(self.free_gpus) < want:
                return None
            return self._pack(sorted(self.free_gpus), want, prefer_empty=self.cfg.policy == "shared")
        # opportunistic: node slot counts (static under shared, the coordinator's under antman)
        chosen: list[int] = []
        per_node = self.cfg.gpus_per_node
        wait = self.cfg.policy == "antman" and self.cfg.no_room == "wait"
        for k in range(self.cfg.nodes):
            if len(chosen) >= want:
                break
            free_slots = self.opp_slots[k] - self.node_opp[k]
            if free_slots <= 0 or (wait and (k in self.no_room_nodes or k in self.unfit_nodes)):
                continue
            node_gpus = self.gpus[k * per_node:(k + 1) * per_node]
            room = [g for g in node_gpus if len(g.opp) < self.cfg.slots_per_gpu]
            take = min(want - len(chosen), free_slots, len(room))
            if take <= 0:
                continue
            loads = [GpuLoad(g.local, g.mem_total, g.mem_used, g.util, len(g.guar), len(g.opp), self.now >= g.measured_at)
                     for g in room]
            avoid = [i - k * per_node for i in j.avoid if i // per_node == k]
            if self.cfg.policy == "antman":
                pick = choose_gpus(loads, take, self.cfg.slots_per_gpu, self.cfg.util_threshold, self.cfg.util_window_s,
                                   self.lp_params.target_slowdown, self.cfg.min_progress, avoid, wait)
                if wait and not pick.gpus and not avoid:
                    self.unfit_nodes.add(k)
            else:
                pick = choose_gpus(loads, take, self.cfg.slots_per_gpu, self.cfg.util_threshold, self.cfg.util_window_s)
            chosen.extend(k * per_node + i for i in pick.gpus)
        return chosen if len(chosen) >= want else None

    def _pack(self, free: list[int], want: int, prefer_empty: bool) -> list[int]:
        """Slurm's choice: fill the node with the fewest free GPUs that still fits (less fragmentation),
        lowest indices first; a job larger than a node takes whole nodes first."""
        by_node: dict[int, list[int]] = {}
        for i in free:
            by_node.setdefault(self.gpus[i].node, []).append(i)
        if prefer_empty:
            for lst in by_node.values():
                lst.sort(key=lambda i: (len(self.gpus[i].opp), i))
        fits = [n for n, lst in by_node.items() if len(lst) >= want]
        if fits:
            n = min(fits, key=lambda n: (len(by_node[n]), n))
            return by_node[n][:want]
        out: list[int] = []
        for n in sorted(by_node, key=lambda n: (-len(by_node[n]), n)):
            out.extend(by_node[n][:want - len(out)])
            if len(out) >= want:
                break
        return out

    def _start(self, j: _Job, gpus: list[int]) -> None:
        # Progress begins after the job's start-up (interpreter, framework, first batch), which holds
        # the GPUs but is not throttled: the agent only acts from the first boundary on.
        j.state, j.gpus, j.start, j.t_last, j.view = "RUNNING", gpus, self.now, self.now + self.cfg.start_overhead_s, None
        if j.first_start is None:
            j.first_start = self.now
        if self.cfg.policy == "antman" or not j.ran_as:
            j.ran_as = j.klass
        if j.ran_as == "guaranteed":
            self.usage[j.job.tenant] = self.usage.get(j.job.tenant, 0) + len(gpus)
        self._hold(j, len(gpus))
        self.n_pending -= 1
        key = self._queue_key(j)
        self.dead[key] = self.dead.get(key, 0) + 1
        for i in gpus:
            g = self.gpus[i]
            if j.klass == "guaranteed":
                g.guar.append(j.job.job_id)
                if self.cfg.policy == "antman":
                    g.measured_at = max(g.measured_at, self.now + self.cfg.start_overhead_s + self.cfg.util_window_s)
                    self._push(g.measured_at, _MEASURED, j.job.job_id, i)
            else:
                g.opp.append(j.job.job_id)
                self.node_opp[g.node] += 1
            if j.klass == "guaranteed" or self.cfg.policy in WHOLE_GPU:
                self.free_gpus.discard(i)
        if self.cfg.policy == "shared" and self._oom_on(gpus):
            self._stop(j, "oom")
            return
        self._refresh(gpus)

    def _hold(self, j: _Job, n: int) -> None:
        t = j.job.tenant
        self.tenant_gpus[t] = self.tenant_gpus.get(t, 0) + n
        if self._is_high(j):
            self.high_gpus[t] = self.high_gpus.get(t, 0) + n
        q = self.quotas.get(t)
        if n > 0 and self.cfg.policy in ("quota", "scavenger") and q is not None and n > q and (
                self.cfg.policy == "quota" or self._is_high(j)):
            self.counts["quota_over_alone"] += 1

    def _oom_on(self, gpus: Iterable[int]) -> bool:
        for i in gpus:
            g = self.gpus[i]
            if sum(self.jobs[x].profile.mem_bytes for x in g.guar + g.opp) > g.mem_total:
                return True
        return False

    def _advance(self, j: _Job) -> None:
        if self.now > j.t_last:  # (still starting up otherwise)
            j.work_left -= j.rate * (self.now - j.t_last)
            j.t_last = self.now

    def _finish(self, j: _Job) -> None:
        self._advance(j)
        j.state, j.end = "DONE", self.now
        j.finishes += 1
        self._count_guaranteed(j, -1)
        del self.active[j.job.job_id]
        self._release(j)

    def _stop(self, j: _Job, why: str) -> None:
        """OOM (shared) or requeue after preemption (antman): back to PENDING, work since the last
        checkpoint lost."""
        self._advance(j)
        if why == "oom":
            j.ooms += 1
            self.counts["oom_failures"] += 1
            j.eligible_at = self.now + self.cfg.oom_retry_s
            self._push(j.eligible_at, _WAKE, j.job.job_id, 0)
            lost_s = 0.0  # it fails while allocating, before any progress
        else:
            j.preemptions += 1
            self.counts["preemptions"] += 1
            since_ckpt = (self.now - (j.start or self.now)) % self.cfg.checkpoint_s
            if self.cfg.checkpoint_on_notice and j.notice_at is not None:
                since_ckpt = min(since_ckpt, self.now - j.notice_at)
            j.notice_at = None
            lost_s = since_ckpt
            j.work_left = min(j.duration, j.work_left + j.rate * since_ckpt)
            if self.cfg.policy == "scavenger":  # Slurm's BeginTime; antman's coordinator clears it
                j.eligible_at = self.now + self.cfg.requeue_delay_s
                self._push(j.eligible_at, _WAKE, j.job.job_id, 0)
        j.lost_gpu_s += lost_s * len(j.gpus)
        j.restarts += 1
        j.state, j.view, j.version = "PENDING", None, j.version + 1
        self._release(j)
        self._enqueue(j)
        self.n_pending += 1

    def _release(self, j: _Job) -> None:
        jid = j.job.job_id
        if j.ran_as == "guaranteed":
            self.usage[j.job.tenant] -= len(j.gpus)
        self._hold(j, -len(j.gpus))
        self.sched_dirty = True
        for i in j.gpus:
            g = self.gpus[i]
            if jid in g.guar:
                g.guar.remove(jid)
            if jid in g.opp:
                g.opp.remove(jid)
                self.node_opp[g.node] -= 1
            g.rate.pop(jid, None)
            g.share.pop(jid, None)
            if not g.guar and (self.cfg.policy not in WHOLE_GPU or not g.opp):
                self.free_gpus.add(i)
        gpus, j.gpus = j.gpus, ([] if j.state == "PENDING" else j.gpus)
        self._refresh(gpus)
        if j.state == "DONE":
            j.gpus = gpus

    # -- per-GPU model: shares, memory, rates ------------------------------------------------------

    def _refresh(self, gpus: Iterable[int]) -> None:
        gpus = list(dict.fromkeys(gpus))
        touched: set[str] = set()
        for i in gpus:
            g = self.gpus[i]
            for jid in g.guar + g.opp:
                self._advance(self.jobs[jid])
                touched.add(jid)
        for i in gpus:
            self._model_gpu(self.gpus[i])
            self.dirty_nodes.add(self.gpus[i].node)
            self.unfit_nodes.discard(self.gpus[i].node)
        for jid in touched:
            j = self.jobs[jid]
            if j.state != "RUNNING":
                continue
            rate = min(self.gpus[i].rate.get(jid, 1.0) for i in j.gpus)
            j.rate, j.version, j.view = rate, j.version + 1, None
            if rate > 0:  # 0: paused in place; its resume sets a rate again
                self._push(max(self.now, j.t_last) + max(j.work_left, 0.0) / rate, _FINISH, jid, j.version)

    def _model_gpu(self, g: _Gpu) -> None:
        jobs = self.jobs
        guar = [jobs[x] for x in g.guar]
        opp = [jobs[x] for x in g.opp]
        shares: dict[str, float] = {}
        spill: set[str] = set()
        if self.cfg.policy == "antman" and opp:
            shares, spill = self._local_policy(g, guar, opp)
        else:
            shares = {j.job.job_id: 1.0 for j in opp}
            self._track_slow(g, guar, False)
        here = guar + opp
        # A job's load on the GPU: its duty (production idle time) times its compute share.
        load = {j.job.job_id: j.duty * shares.get(j.job.job_id, 1.0) for j in here}
        total = sum(j.profile.sm_util * load[j.job.job_id] for j in here)
        g.rate = {}
        useful = 0.0
        for j in here:
            jid = j.job.job_id
            r = 1.0 / j.profile.slowdown(((o.profile.kind, load[o.job.job_id]) for o in here if o is not j), j.duty)
            if jid in shares:
                r *= shares[jid]
            if jid in spill:
                r *= SPILL_RATE
            g.rate[jid] = r
            useful += r * j.util  # the busy time it would need alone for the progress it makes
        g.share = shares
        new_util = min(1.0, total)
        new_mem = min(g.mem_total, sum(j.profile.mem_bytes for j in guar + opp
                                       if shares.get(j.job.job_id, 1.0) > 0 or j in guar))
        self.util_sum += new_util - g.util
        self.mem_sum += new_mem - g.mem_used
        self.useful_sum += useful - g.useful
        g.util, g.mem_used, g.useful = new_util, new_mem, useful
        if self.cfg.policy == "antman":
            self._track_crawl(g, guar, opp)

    def _local_policy(self, g: _Gpu, guar: list[_Job], opp: list[_Job]) -> tuple[dict[str, float], set[str]]:
        """Memory limits and preemption needs from ``local_policy.decide`` on this GPU; compute
        shares from its AIMD loop's steady state for this mix of profiles."""
        info = lp.GpuInfo(0, g.mem_total)
        can_pause = self.lp_params.pause_max_s is not None
        js = [lp.JobInfo(j.job.job_id, "guaranteed", (0,), j.start or 0.0, j.profile.mem_bytes) for j in guar]
        js += [lp.JobInfo(j.job.job_id, "opportunistic", (0,), j.start or 0.0, j.profile.mem_bytes,
                          can_pause=can_pause) for j in opp]
        before = g.lp_state.paused
        d = lp.decide(lp.Snapshot((info,), tuple(js)), g.lp_state, self.lp_params, self.now)
        g.lp_state = d.state
        if before or d.state.paused:
            self._pauses_changed(g, before, d)
        if d.new_preemptions and guar and g.need is None:
            g.need = cp.PreemptNeed(self.node_names[g.node], g.local, guar[0].job.job_id,
                                    d.new_preemptions[0].reason, self.now)
        if not any(j.job.job_id in d.state.preempted for j in opp):
            g.need = None
        steady, slow = None, False
        if guar:
            # All opportunistic jobs on a GPU get the same share; the guaranteed job then slows by
            # 1 + share x c (workloads module doc), so the AIMD loop's steady state depends on c alone.
            c = guar[0].profile.slowdown(((o.profile.kind, o.duty) for o in opp), guar[0].duty) - 1.0
            steady, slow = self._steady_shares(_c_grid(c), len(opp))
        self._track_slow(g, guar, slow)
        shares: dict[str, float] = {}
        spill: set[str] = set()
        for j in opp:
            jid = j.job.job_id
            lim = d.limits[jid]
            if jid in d.state.paused:
                shares[jid] = 0.0  # its state on the host: no progress, no load, no GPU memory
            elif jid in d.state.preempted or steady is None:
                shares[jid] = min(lim.compute_share, 1.0)
            else:
                shares[jid] = steady
            if lim.mem_limit_bytes is not None and lim.mem_limit_bytes < j.profile.mem_bytes:
                spill.add(jid)
        return shares, spill

    def _pauses_changed(self, g: _Gpu, before: Mapping[str, lp.PauseRecord], d: lp.Decision) -> None:
        """Counts pauses and their time, charges each resume the copy both ways, and schedules the
        next look at this GPU: when a hold or a pause budget can run out (nothing else would call)."""
        for rec in d.new_pauses:
            self.counts["pauses"] += 1
        for jid in d.resumes:
            rec = before.get(jid)
            j = self.jobs[jid]
            cost = 2.0 * j.profile.mem_bytes / self.cfg.pause_bandwidth_bytes_s
            self._advance(j)
            j.work_left += cost
            self.pause_cost_s += cost
            self.counts["resumes"] += 1
            if rec is not None:
                self.paused_s += self.now - rec.since_unix
        for jid, rec in before.items():
            if jid not in d.state.paused and jid not in d.resumes:  # requeued from the pause, or gone
                self.paused_s += self.now - rec.since_unix
        for rec in d.state.paused.values():
            due = [rec.since_unix + self.lp_params.pause_max_s]
            if rec.fits_since_unix is not None:
                due.append(rec.fits_since_unix + self.lp_params.resume_hold_s)
            t = min(x for x in due if x > self.now) if any(x > self.now for x in due) else None
            if t is not None:
                self._push(t, _PAUSE_CHECK, rec.job_id, g.index)

    def _track_slow(self, g: _Gpu, guar: list[_Job], slow: bool) -> None:
        """The local policy's preemption for speed: a GPU whose mix stays over target at the floor
        asks the coordinator for room ``slow_preempt_s`` later (``_cycle`` raises the need)."""
        wait = self.lp_params.slow_preempt_s
        if not (slow and guar and wait is not None):
            g.slow_since = None
            self.slow_gpus.discard(g.index)
        elif g.slow_since is None:
            g.slow_since = self.now
            self.slow_gpus.add(g.index)
            self._push(self.now + wait, _SLOW, guar[0].job.job_id, 0)

    def _slow_needs(self) -> None:
        wait = self.lp_params.slow_preempt_s
        for i in sorted(self.slow_gpus):
            g = self.gpus[i]
            if g.slow_since is None or self.now - g.slow_since < wait or g.need is not None or not g.guar:
                continue
            g.need = cp.PreemptNeed(self.node_names[g.node], g.local, g.guar[0],
                                    f"over the slowdown target at the minimum share for {self.now - g.slow_since:.0f} s",
                                    self.now)
            # Re-armed by the next change of this GPU's jobs if the mix is still too slow.
            g.slow_since = None
            self.slow_gpus.discard(i)

    def _steady_shares(self, c: float, n: int) -> tuple[float, bool]:
        """The mean compute share of each of ``n`` opportunistic jobs beside a guaranteed job that
        slows by 1 + share x ``c``, over the last half of 120 reports of ``local_policy.decide``, and
        whether the guaranteed job ends over target at the floor share (its slow_preempt_s rule)."""
        key = (self.lp_params, c, n)
        hit = _SHARE_CACHE.get(key)
        if hit is not None:
            return hit
        base_ms = 100.0  # only ratios to it matter
        gjob = lp.JobInfo("g", "guaranteed", (0,), 0.0, 0)
        ojobs = tuple(lp.JobInfo(f"o{k}", "opportunistic", (0,), 1.0 + k, 0) for k in range(n))
        info = (lp.GpuInfo(0, 1 << 50),)
        # A baseline report alone first, as the sidecar sees it before the opportunistic job arrives.
        alone = (replace(gjob, iteration=0, iteration_ms=base_ms),)
        state = lp.decide(lp.Snapshot(info, alone), lp.PolicyState(), self.lp_params, 0.0).state
        history: list[float] = []
        share = self.lp_params.initial_share
        for it in range(1, 121):
            rep = replace(gjob, iteration=it, iteration_ms=base_ms * (1.0 + share * c))
            d = lp.decide(lp.Snapshot(info, (rep,) + ojobs), state, self.lp_params, float(it))
            state = d.state
            share = d.limits["o0"].compute_share
            history.append(share)
        tail = history[-60:]
        out = (sum(tail) / len(tail), bool(state.over_since))
        _SHARE_CACHE[key] = out
        return out

    def _track_crawl(self, g: _Gpu, guar: list[_Job], opp: list[_Job]) -> None:
        """The local policy's crawling rule on the modelled progress (each job's rate on this GPU);
        a cycle is due when a crawler's ``move_after_s`` is over."""
        g.progress = {j.job.job_id: g.rate[j.job.job_id] for j in opp}
        order = {0: [j.job.job_id for j in sorted(opp, key=lambda j: (j.start or 0.0, j.job.job_id))]}
        before = g.crawl
        g.crawl = lp.crawling(g.progress, order, {0} if guar else set(), before, self.now, self.lp_params)
        wait = self.cfg.move_after_s
        if g.crawl:
            self.crawl_gpus.add(g.index)
            if wait is not None:
                for jid, since in g.crawl.items():
                    if jid not in before:
                        self._push(since + wait, _SLOW, jid, 0)
        else:
            self.crawl_gpus.discard(g.index)

    # -- the coordinator cycle (antman) -----------------------------------------------------------

    def _view(self, j: _Job) -> cp.JobView:
        if j.view is None:
            node = self.node_names[self.gpus[j.gpus[0]].node] if j.state == "RUNNING" and j.gpus else None
            ckpt = None
            if j.state == "RUNNING" and j.start is not None:
                ckpt = j.start + math.floor((self.now - j.start) / self.cfg.checkpoint_s) * self.cfg.checkpoint_s
            j.view = cp.JobView(j.job.job_id, j.job.tenant, "u", j.state, j.requested, j.klass, j.job.gpus, node,
                                j.submit, j.start if j.state == "RUNNING" else None, j.restarts,
                                ckpt if ckpt and ckpt > (j.start or 0) else None, j.held)
        return j.view

    def _views(self, keep: Collection[str]) -> tuple[cp.JobView, ...]:
        """The jobs a cycle looks at. Running guaranteed jobs matter to the policy core only through
        their tenant's sum of GPUs (quota use), unless a preemption need names them, so they are
        passed as one view per tenant: the same decisions from far fewer views (a cluster of 1,000
        GPUs runs hundreds of them)."""
        out: list[cp.JobView] = []
        held_gpus: dict[str, int] = {}
        for j in self.active.values():
            if j.state == "RUNNING" and j.klass == "guaranteed" and j.job.job_id not in keep:
                held_gpus[j.job.tenant] = held_gpus.get(j.job.tenant, 0) + j.job.gpus
            else:
                out.append(self._view(j))
        for tenant, n in held_gpus.items():
            out.append(cp.JobView(f"running-guaranteed:{tenant}", tenant, "u", "RUNNING", "guaranteed", "guaranteed",
                                  n, None, 0.0, 0.0, 0, None, False))
        return tuple(out)

    def _node_view(self, k: int) -> cp.NodeView:
        # A GPU changes only through _refresh, which marks its node dirty: a clean node's GPU views
        # are reused (a move looks at every node, and a cluster of 500 GPUs has hundreds of them).
        gv = self.gpu_views.get(k)
        if gv is None or k in self.dirty_nodes:
            per = self.cfg.gpus_per_node
            gv = self.gpu_views[k] = tuple(
                cp.GpuView(g.local, g.mem_total, g.mem_used, g.util, tuple(g.guar), tuple(g.opp),
                           tuple(g.progress.items()), tuple(g.crawl.items()), self.now >= g.measured_at)
                for g in self.gpus[k * per:(k + 1) * per])
        return cp.NodeView(self.node_names[k], gv, self.cfg.slots_per_gpu * self.cfg.gpus_per_node,
                           self.opp_slots[k], self.now)

    def _cycle(self) -> None:
        self._slow_needs()
        needs = tuple(g.need for g in self.gpus if g.need is not None)
        st = self.cp_state
        self.counts["cycles"] += 1
        views = self._views({n.job_id for n in needs})
        self.quota_file = self._quota_use(views)
        nodes = set(self.dirty_nodes)
        for n in needs:
            nodes.add(self.node_index[n.node])
        for p in list(st.preempting.values()) + list(st.requeued.values()):
            nodes.add(self.node_index[p.node])
        wait = self.cfg.move_after_s
        if wait is not None and any(self.now - since >= wait for i in self.crawl_gpus
                                    for since in self.gpus[i].crawl.values()):
            nodes = set(range(self.cfg.nodes))  # a move looks for a better GPU anywhere
        snap = cp.Snapshot(self.now, views, tuple(self._node_view(k) for k in sorted(nodes)), self.quotas, needs)
        self.dirty_nodes = set()
        decisions, self.cp_state = cp.decide(snap, st, self.cp_params)
        per = self.cfg.gpus_per_node
        for jid, a in self.cp_state.avoid.items():
            j = self.jobs.get(jid)
            if j is not None:
                j.avoid = (self.node_index[a.node] * per + a.gpu,)
        for d in decisions:
            self._apply(d)
            if d.kind == "preempt_notice":  # wake the coordinator when the grace time is over
                self._push(self.now + d.grace_s, _WAKE, d.job_id, 0)
        # What the decisions changed (slots, classes, holds) is for the next cycle to see; a pending
        # preemption or requeue needs the next cycle too.
        st = self.cp_state
        if decisions or self.dirty_nodes or st.preempting or any(not r.made_eligible for r in st.requeued.values()):
            self.changed = True

    def _apply(self, d: cp.Decision) -> None:
        kind = d.kind
        if kind == "set_opp_slots":
            k = self.node_index[d.node]
            self.opp_slots[k] = d.slots
            inp = d.inputs
            if inp["slurm_in_use"] + max(0, inp["free_slots"] - inp["unseen"]) < d.slots:
                self.no_room_nodes.add(k)
            else:
                self.no_room_nodes.discard(k)
            return
        j = self.jobs.get(d.job_id)
        if j is None:
            return
        j.view = None
        if kind == "set_class":
            # Slurm 22.05 keeps scheduling a pending job by the GRES it was submitted with, even after
            # scontrol update TresPerNode (docs/architecture.md): the class it runs as is fixed at
            # submission. Only the hold release takes effect.
            if d.to_class != j.klass:
                self.counts["set_class_ineffective"] += 1
            if d.release_hold:
                j.held = False
        elif kind == "hold_for_quota":
            j.held = True
        elif kind == "release_hold":
            j.held = False
        elif kind == "upgrade" and j.state == "RUNNING":
            self.counts["upgrades"] += 1
            j.klass = j.ran_as = "guaranteed"
            self.usage[j.job.tenant] = self.usage.get(j.job.tenant, 0) + len(j.gpus)
            for i in j.gpus:
                g = self.gpus[i]
                if d.job_id in g.opp:
                    g.opp.remove(d.job_id)
                    self.node_opp[g.node] -= 1
                    g.guar.append(d.job_id)
                    self.free_gpus.discard(i)
            self._refresh(j.gpus)
        elif kind == "requeue" and j.state == "RUNNING":
            self._stop(j, "preempt")
        elif kind == "preempt_notice" and j.state == "RUNNING":
            j.notice_at = self.now
            if d.inputs.get("move"):
                self.counts["moves"] += 1
        # make_eligible: the simulated Slurm has no BeginTime wait to clear.

    # -- results ------------------------------------------------------------------------------------

    def _result(self) -> SimResult:
        from .metrics import summarize
        rows = [{
            "job_id": j.job.job_id, "tenant": j.job.tenant, "gpus": j.job.gpus, "profile": j.profile.name,
            "class": j.ran_as or j.klass, "submitted_as": j.submitted_as, "submit_s": j.submit, "first_start_s": j.first_start, "end_s": j.end,
            "duration_s": j.duration, "restarts": j.restarts, "preemptions": j.preemptions, "ooms": j.ooms,
            "lost_gpu_s": j.lost_gpu_s, "util": round(j.util, 4),
        } for j in self.jobs.values()]
        n = len(self.gpus)
        span = max(self.t_end_measure - self.t0, 0.0)
        # Up to the last completion, not the last event: a stale finish event can come later.
        makespan = max((j.end for j in self.jobs.values() if j.end is not None), default=self.t0) - self.t0
        metrics = summarize(rows)
        metrics.update(
            policy=self.cfg.policy, gpus=n,
            sm_util=(self.area_util / (n * span)) if span else 0.0,
            mem_util=(self.area_mem / (n * span * self.cfg.gpu_mem_bytes)) if span else 0.0,
            measure_window_s=[self.t0, self.t_end_measure],
            sm_util_makespan=(self.area_util_all / (n * makespan)) if makespan > 0 else 0.0,
            mem_util_makespan=(self.area_mem_all / (n * makespan * self.cfg.gpu_mem_bytes)) if makespan > 0 else 0.0,
            # Progress-weighted: the busy time each job would need alone for the progress it makes,
            # so a GPU busy with two jobs that each crawl counts for little (issue 12's metric).
            useful_util=(self.area_useful / (n * span)) if span else 0.0,
            useful_util_queued=(self.area_useful_queued / (n * self.t_queued)) if self.t_queued else None,
            queued_s=self.t_queued,
            jobs_done_twice=sum(1 for j in self.jobs.values() if j.finishes > 1),
            moves=self.counts["moves"], quota_over_alone=self.counts["quota_over_alone"],
            pauses=self.counts["pauses"], resumes=self.counts["resumes"], paused_s=self.paused_s,
            pause_cost_s=self.pause_cost_s,
            utilisation=self.cfg.utilisation, util_scale=self.cfg.util_scale,
            oom_failures=self.counts["oom_failures"], upgrades=self.counts["upgrades"],
            set_class_ineffective=self.counts["set_class_ineffective"],
            coordinator_cycles=self.counts["cycles"],
            quotas=dict(self.quotas),
        )
        return SimResult(self.cfg.policy, metrics, rows, _downsample(self.series, self.cfg.max_samples))


def _downsample(series: list[tuple[float, float, float]], k: int) -> list[tuple[float, float, float]]:
    if len(series) <= k:
        return series
    step = len(series) / k
    return [series[int(i * step)] for i in range(k)]


def tenant_quotas(jobs: Sequence[Job], gpus: int, quota_scale: float) -> dict[str, int]:
    """Each tenant's guaranteed GPUs: its share of the jobs' GPU-time times the cluster size times
    ``quota_scale`` (at least 1). None for an openb pod list, whose pods carry their class."""
    if any(j.qos is not None for j in jobs):
        return {}
    gpu_time: dict[str, float] = {}
    for j in jobs:
        gpu_time[j.tenant] = gpu_time.get(j.tenant, 0.0) + j.duration_s * j.gpus
    total = sum(gpu_time.values()) or 1.0
    size = gpus * quota_scale
    return {t: max(1, int(size * g / total)) for t, g in gpu_time.items()}


def simulate(jobs: Sequence[Job], cfg: SimConfig) -> SimResult:
    return Simulator(jobs, cfg).run()
