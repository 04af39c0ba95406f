"""The simulator's settings: the cluster, how the trace is scaled, and the knobs of each policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from slurm_antman.policy import cluster as cp
from slurm_antman.policy.node import core as lp

from .. import utilisation
from ..trace_run import TraceRunConfig
from .elastic_array import ARRAY_GROW_S, ARRAY_SHRINK_S
from .slot_fill import COMPUTE_MODES, SlotFillParams

POLICIES = ("exclusive", "quota", "scavenger", "shared", "antman")
NO_ROOM = ("fallback", "wait")
# How jobs are laid on nodes: "nodes" as the replay and a site submit them (-N: a job up to a node's
# GPUs on one node, a larger one on as few nodes as hold it); "spread" is the model until 2026-11-26,
# which took free GPUs wherever they were, kept to compare with.
PLACEMENTS = ("nodes", "spread")
# How the queue is passed over for whole GPUs: "easy": strict submission order with a reservation for
# the first job that does not fit, later jobs started only where they do not delay it (scheduler.py);
# "first_fit": any job that fits starts, in order, no reservation (the model until 2026-11-26).
BACKFILLS = ("easy", "first_fit")
# Policies under which every job holds whole GPUs alone.
WHOLE_GPU = frozenset({"exclusive", "quota", "scavenger"})


@dataclass(frozen=True)
class SimConfig(TraceRunConfig):
    """A simulated run: the fields every run of a trace has (``TraceRunConfig``), then the simulator's own."""

    util_threshold: float = 0.8
    # opportunistic.utilization_window_s: the sidecar's utilisation average, and how long a new
    # guaranteed job must have iterated before its GPU counts as measured (slurm_antman.policy.node.placement).
    util_window_s: float = 10.0
    # antman: pause in place before requeue (sidecar.pause_max_s; None: requeue at once), its resume
    # hold (sidecar.resume_hold_s), and the cost of one pause and resume: the job's GPU memory over
    # this bandwidth, each way, lost from its progress. 12e9 B/s: PCIe 3.0 x16 (15.75 GB/s raw, the
    # bus of PipeSwitch's testbed, OSDI'20 section 6) at the ~75 % pinned copies reach; `antman bench
    # gpu` part 7 measures this on the lent GPU nodes.
    pause_max_s: Optional[float] = None
    resume_hold_s: float = 10.0
    pause_bandwidth_bytes_s: float = 12e9
    checkpoint_s: float = 1800.0  # opportunistic jobs checkpoint this often (estimate)
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
    slow_preempt_s: Optional[float] = lp.NodePolicyParams.slow_preempt_s
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
    # Slurm's placement and backfill, and the cost of crossing nodes (docs/workload_model.md, "Placement,
    # backfill and locality").
    placement: str = "nodes"
    backfill: str = "easy"
    # Slurm 22.05's bf_window default (1440 minutes, slurm.conf(5)): a job that cannot start within
    # it gets no reservation.
    bf_window_s: float = 86400.0
    # A multi-node job's per-GPU rate times Pollux's measured efficiency of its placement
    # (locality_data.py); False: a spread job runs as fast as a packed one (the model until 2026-11-26).
    locality: bool = True
    # topology/tree: this many nodes under each leaf switch (0: all under one). A multi-node job goes
    # under one switch when one has room; antman's opportunistic jobs wait up to switch_wait_s for one
    # (job_submit.lua's --switches=1@opportunistic.switch_wait_s), guaranteed jobs ask nothing.
    nodes_per_switch: int = 0
    switch_wait_s: Optional[float] = 300.0
    # antman: the share of multi-GPU jobs that are elastic (--antman-elastic=1:g), the seconds a width
    # change stops a job (2.2 s: the devcluster's measured median, tests/test_cluster_elastic.py), and
    # the least time between two changes of one job (elastic.py).
    elastic_share: float = 0.0
    # How opportunistic jobs beside a guaranteed job use the GPU under antman: "duty" (the throttle's
    # share from the AIMD loop) or "slots" (the guaranteed job's idle slots, slot_fill.py).
    compute: str = "duty"
    slot_fill: SlotFillParams = SlotFillParams()

    @property
    def fill(self) -> float:
        """The placement's prediction of slot filling (policy.progress): 0 unless --compute slots."""
        return self.slot_fill.fill_efficiency if self.compute == "slots" and self.policy == "antman" else 0.0
    elastic_change_s: float = 2.2
    elastic_hold_s: float = 300.0
    # What-ifs not built on the real path (elastic.py): start narrow when there is no room for all of
    # a job, grow wherever the node policy places an opportunistic job.
    elastic_narrow_start: bool = False
    elastic_grow_shared: bool = False
    # Elastic jobs wider than a node, as the real path builds them: a job array of one-node tasks
    # (elastic_array.py). Off by default. A shrink and a grow across nodes stop the training this long
    # (ARRAY_SHRINK_S, ARRAY_GROW_S: measured on the devcluster), and the training runs on at least this
    # many tasks (MIN = this x G).
    elastic_arrays: bool = False
    elastic_array_shrink_s: float = ARRAY_SHRINK_S
    elastic_array_grow_s: float = ARRAY_GROW_S
    elastic_array_min_tasks: int = 1
    # The coordinator holds an array's other tasks while its rendezvous host is pending (what-if, off).
    elastic_array_host_first: bool = False
    # A study, not a policy (docs/evaluation.md, "Two follow-ups on the whole trace's loss"): while a
    # one-GPU opportunistic job waits for room (no_room=wait), at most once per this many simulated
    # seconds, which rule keeps each GPU of the cluster from it (policy.node.placement.exclusion;
    # "node_slots:RULE": its node's opportunistic Slurm slots are taken too), sampled at the scheduling
    # passes where such a job finds no room. None: no study. It reads the state only: the run is the
    # same with it.
    wait_study_s: Optional[float] = None
    # What-if, not built on the real path: under no_room=wait, an opportunistic job waits for room at
    # most this long after its submission, then starts as under fallback. None: it waits as long as it takes.
    no_room_wait_max_s: Optional[float] = None
    # Each tenant's guaranteed GPUs as the site set them (Slurm accounting's GrpTRES=gres/gpu=N, read by
    # ``--quotas-from-slurm``), as (tenant, GPUs) pairs; None: derived from the trace (``quota_scale``).
    quotas: Optional[tuple[tuple[str, int], ...]] = None

    def __post_init__(self) -> None:
        if self.no_room_wait_max_s is not None and not self.no_room_wait_max_s >= 0:
            raise ValueError(f"--no-room-wait-max-s must be >= 0 seconds, got {self.no_room_wait_max_s!r}")
        if self.wait_study_s is not None and not self.wait_study_s > 0:
            raise ValueError(f"--wait-study-s must be > 0 simulated seconds, got {self.wait_study_s!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy {self.policy!r} is not allowed; allowed: {', '.join(POLICIES)}")
        for name in ("nodes", "gpus_per_node", "slots_per_gpu"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.speedup > 0:
            raise ValueError(f"--speedup must be > 0, got {self.speedup}")
        self._check_gpu_memory()
        self._check_oom_retry()
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
        if self.placement not in PLACEMENTS:
            raise ValueError(f"--placement {self.placement!r} is not allowed; allowed: {', '.join(PLACEMENTS)}")
        if self.backfill not in BACKFILLS:
            raise ValueError(f"--backfill {self.backfill!r} is not allowed; allowed: {', '.join(BACKFILLS)}")
        if not self.bf_window_s > 0:
            raise ValueError(f"bf_window_s must be > 0, got {self.bf_window_s}")
        if self.nodes_per_switch < 0:
            raise ValueError(f"--nodes-per-switch must be >= 0 (0: one switch), got {self.nodes_per_switch}")
        if self.compute not in COMPUTE_MODES:
            raise ValueError(f"--compute {self.compute!r} is not allowed; allowed: {', '.join(COMPUTE_MODES)}")
        self.slot_fill.check()
        if not 0 <= self.elastic_share <= 1:
            raise ValueError(f"--elastic-share must be in [0, 1], got {self.elastic_share}")
        if not self.elastic_change_s >= 0:
            raise ValueError(f"--elastic-change-s must be >= 0, got {self.elastic_change_s}")
        if not self.elastic_hold_s >= 0:
            raise ValueError(f"--elastic-hold-s must be >= 0, got {self.elastic_hold_s}")
        if not self.elastic_array_shrink_s >= 0:
            raise ValueError(f"--elastic-array-shrink-s must be >= 0, got {self.elastic_array_shrink_s}")
        if not self.elastic_array_grow_s >= 0:
            raise ValueError(f"--elastic-array-grow-s must be >= 0, got {self.elastic_array_grow_s}")
        if self.elastic_array_min_tasks < 1:
            raise ValueError(f"--elastic-array-min-tasks must be >= 1, got {self.elastic_array_min_tasks}")
        if self.switch_wait_s is not None and not self.switch_wait_s >= 0:
            raise ValueError(f"--switch-wait-s must be >= 0 (or 'none'), got {self.switch_wait_s}")

