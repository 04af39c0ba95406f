"""The event loop and each job's life: submission (job_submit.lua's class), start, progress, finish,
requeue; the utilisation integrals and the result.

Which jobs are opportunistic: a Philly job is submitted ``auto`` and resolved at submission, as
job_submit.lua does: guaranteed when its tenant's (virtual cluster's) GPUs in the quota file plus its
own fit the tenant's quota, else opportunistic. The quota file is rewritten once per cycle (so it can
be a cycle old) under every policy. A tenant's quota is its share of the window's GPU-time times the
cluster size times ``quota_scale``. An openb pod of qos BE asks for opportunistic, every other pod for
guaranteed, with no quotas. ``exclusive`` tags jobs the same way (for the guaranteed-JCT metric) but
runs every job alone on its GPUs. A pending job keeps the class it was submitted with: Slurm 22.05
schedules it by its original GRES (docs/architecture.md), so a coordinator ``SetClass`` on a pending
job only releases its hold.
"""

from __future__ import annotations

import heapq
from dataclasses import replace
from typing import Mapping, Optional, Sequence

from slurm_antman.policy import cluster as cp
from slurm_antman.policy.cluster.quota import fits_quota
from slurm_antman.policy.node import core as lp

from .. import utilisation
from ..trace_run import oom_resubmit_delay
from ..traces import TraceJob
from ..workloads import assign
from .antman import AntmanAdapter
from .backfill import RunningEnds
from .config import WHOLE_GPU, SimConfig
from .elastic import ElasticWidth, is_elastic
from .elastic_array import ElasticArrays
from .interference import GpuInterference
from .scheduler import SlurmScheduler
from .state import CYCLE, FINISH, MEASURED, PAUSE_CHECK, REQUEUE, SUBMIT, WAKE, SimGpu, SimJob, SimResult


class Simulator(SlurmScheduler, GpuInterference, AntmanAdapter, ElasticWidth, ElasticArrays):
    """One run: the state every part works on, the event loop, and each job's life. The scheduler, the
    GPU model and the antman adapter are mixins, not objects of their own: they read and change the
    same jobs, GPUs and counters at every event, so the split follows the ideas and the state stays here."""

    def __init__(self, jobs: Sequence[TraceJob], cfg: SimConfig):
        self.cfg = cfg
        n = cfg.nodes * cfg.gpus_per_node
        self.gpus = [SimGpu(i, i // cfg.gpus_per_node, i % cfg.gpus_per_node, cfg.gpu_mem_bytes) for i in range(n)]
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
        # Each node's answers to opportunistic placement, until one of its GPUs changes (opp_place.py).
        self.node_picks: dict[int, dict[tuple[int, int, bool], tuple[tuple[int, ...], bool]]] = {}
        # Counts the changes of any node's room (opp_place.py): an opportunistic job's shape (GPUs
        # a node, wait) that found no room at a count finds none while it stands.
        self.place_epoch = 0
        self.node_stamp = [0] * cfg.nodes  # per node: place_epoch at its last change of room
        self.failed_shapes: dict[tuple, int] = {}
        self.failed_picks: dict[tuple, dict[int, list[int]]] = {}  # a multi-node shape's node answers then
        self.jobs: dict[str, SimJob] = {}
        # The queue, one per (scavenger's high partition?, tenant, GPUs asked), each in submission
        # order (a requeued job at the end): (job, ticket) entries, of which only the one with the
        # job's current ticket counts. Split so that a pass skips at once the jobs that their tenant's
        # quota keeps waiting, instead of stepping over thousands of them (``_in_order``).
        self.queues: dict[tuple[bool, str, int], list[tuple[str, int]]] = {}
        self.heads: dict[tuple[bool, str, int], int] = {}  # per queue: entries before it have all left
        self.dead: dict[tuple[bool, str, int], int] = {}   # per queue: entries that left it
        # Per queue: its entries' backfill run estimates (scheduler._run_estimate, in step with the
        # queue), the tickets of its guaranteed entries and that of its last elastic one; and a scheduling
        # pass's way to step over jobs that can no longer start (scheduler's skip_to; None between passes).
        self.queue_ests: dict[tuple[bool, str, int], list[float]] = {}
        self.queue_guaranteed: dict[tuple[bool, str, int], list[int]] = {}
        self.queue_last_elastic: dict[tuple[bool, str, int], int] = {}
        self.skip_to = None
        self.heap: list[tuple] = []
        self.seq = 0
        self.now = 0.0
        self.quotas = self._quotas(jobs)
        self.cp_params = cp.PolicyParams(
            grace_s=cfg.grace_s, slots_per_gpu=cfg.slots_per_gpu, util_threshold=cfg.util_threshold,
            min_opp_mem_bytes=lp.NodePolicyParams().min_opportunistic_bytes,
            headroom_bytes=lp.NodePolicyParams().headroom_bytes, queue_to_opportunistic_s=None)
        self.cp_params = replace(self.cp_params, min_progress=cfg.min_progress, move_after_s=cfg.move_after_s,
                                 move_gain=cfg.move_gain, upgrade_running=cfg.upgrade_running, slot_fill=cfg.fill,
                                 elastic_hold_s=cfg.elastic_hold_s)
        self.lp_params = lp.NodePolicyParams(grace_s=cfg.grace_s, slow_preempt_s=cfg.slow_preempt_s,
                                         min_progress=cfg.min_progress,
                                         crawl_below=lp.crawl_threshold(cfg.min_progress, cfg.move_gain),
                                         pause_max_s=cfg.pause_max_s,
                                         resume_hold_s=cfg.resume_hold_s)
        self.cp_state = cp.CoordinatorState.empty()
        self.dirty_nodes: set[int] = set(range(cfg.nodes))
        self.gpu_views: dict[int, tuple[cp.GpuView, ...]] = {}  # per node, while it is not dirty
        self.tenant_views: dict[tuple[str, int], cp.JobView] = {}  # antman._views: a tenant's running guaranteed GPUs
        # Per node, while it is not dirty: the most a GPU there promises a moved job (antman._cycle).
        self.best_target: list[float] = [float("-inf")] * cfg.nodes
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
        self.resv = None                         # backfill's reservation from the last full pass
        self.free_by_node = None                 # free_gpus by node, sorted; None when it changed
        self.series: list[tuple[float, float, float]] = []
        # Kept up to date so a scheduling pass over a long queue costs little per job.
        self.free_gpus: set[int] = set(range(n))      # no guaranteed job (exclusive: no job at all)
        self.usage: dict[str, int] = {}               # tenant -> GPUs running as guaranteed
        self.wait_study: dict[str, int] = {}  # cfg.wait_study_s: rule -> GPU samples (scheduler._study_wait)
        self.wait_study_next = 0.0
        self.wait_woken: set[str] = set()  # no_room_wait_max_s: jobs whose end-of-wait pass is queued
        self.counts = {"oom_failures": 0, "preemptions": 0, "upgrades": 0, "cycles": 0,
                       "set_class_ineffective": 0, "moves": 0, "quota_over_alone": 0, "pauses": 0, "resumes": 0,
                       "width_changes": 0, "shrinks": 0, "grows": 0, "arrays": 0, "array_shrinks": 0,
                       "array_grows": 0, "array_requeues": 0, "array_stalls": 0, "array_shared_gpu_starts": 0,
                       "array_task_requeues": 0, "array_host_alone": 0}
        self.array_idle_gpu_s = 0.0  # held by tasks of elastic arrays whose training did not run
        self.whole_requeues: dict[str, int] = {}  # multi-GPU jobs' preemption notices, by cause (antman.py)
        self.paused_s = 0.0      # job-seconds spent paused in place (ended pauses)
        self.pause_cost_s = 0.0  # progress lost moving state out and back
        # Jobs that are PENDING or RUNNING, in submission order: what a cycle looks at (not all jobs).
        self.active: dict[str, SimJob] = {}
        # The running jobs' ends a reservation waits for, kept in order as they change (backfill.py).
        self.ends = RunningEnds()
        # What job_submit.lua reads (antman_quota.lua): guaranteed GPUs each tenant holds or is about
        # to hold, as the coordinator last wrote it.
        self.quota_file: dict[str, int] = {}
        self.last_cycle: Optional[float] = None
        self.changed = True          # something happened since the last cycle
        self.cycle_queued = False    # a CYCLE event is in the heap
        self.force_cycle = False     # run the next cycle even if the last was under cycle_s ago
        starts = [j.submit_s for j in jobs]
        self.t0 = min(starts) / cfg.speedup if starts else 0.0
        self.t_end_measure = max(starts) / cfg.speedup if starts else 0.0
        for j in jobs:
            self._add(j)

    # -- setup ----------------------------------------------------------------------------------

    def _quotas(self, jobs: Sequence[TraceJob]) -> Mapping[str, int]:
        if self.cfg.quotas is not None:
            return dict(self.cfg.quotas)
        return tenant_quotas(jobs, len(self.gpus), self.cfg.quota_scale)

    def _add(self, j: TraceJob) -> None:
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
        sj = SimJob(j, prof, requested, klass, submit, dur, work_left=dur, submitted_as=klass,
                  util=duty * prof.sm_util, duty=duty,
                  elastic=is_elastic(j.job_id, j.gpus, self.cfg.elastic_share, self.cfg.seed,
                                     None if self.cfg.elastic_arrays else self.cfg.gpus_per_node))
        self.jobs[j.job_id] = sj
        self._push(submit, SUBMIT, j.job_id, 0)

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
                if kind == CYCLE:
                    self.cycle_queued = False
                    continue
                j = self.jobs[jid]
                if kind == SUBMIT:
                    self._submit(j)
                elif kind == FINISH:
                    if j.state != "RUNNING" or version != j.version:
                        continue  # a stale finish time: the job's rate changed since
                    self._finish(j)
                elif kind == WAKE:
                    self.sched_dirty = True  # a job's retry or BeginTime is over
                    self.force_cycle = True  # a grace time is over: requeue now, not a cycle later
                elif kind == MEASURED:  # a new guaranteed job now shows in its GPU's utilisation
                    g = self.gpus[version]
                    if self.now >= g.measured_at:
                        self.dirty_nodes.add(g.node)
                        self._node_changed(g.node)
                        self.sched_dirty = True
                elif kind == PAUSE_CHECK:  # a paused job's hold or pause budget may be over
                    g = self.gpus[version]
                    if g.lp_state.paused:
                        self._refresh([version])
                        self.changed = True
                elif kind == REQUEUE:  # scavenger: Slurm requeues a preempted job after its grace time
                    if j.state == "RUNNING" and version == j.restarts and j.notice_at is not None:
                        self._stop(j, "preempt")
                # SLOW (a GPU's slow_preempt_s is over): only a change, handled at the next due cycle
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
        # (last + cycle_s can round to now while now - last is still short of cycle_s: a cycle queued
        # for then would come back at this very instant, for ever, so it is due now)
        due = (self.last_cycle is None or self.now - self.last_cycle >= self.cfg.cycle_s or self.force_cycle
               or self.last_cycle + self.cfg.cycle_s <= self.now)
        if not due:
            if not self.cycle_queued:
                self.cycle_queued = True
                self._push(self.last_cycle + self.cfg.cycle_s, CYCLE, "", 0)
            return
        self.last_cycle, self.changed, self.force_cycle = self.now, False, False
        if self.cfg.policy == "antman":
            self._cycle()
        else:
            # Without a coordinator nothing is held and a class never changes after submission, so
            # what quota_use counts (guaranteed jobs running or pending) is kept as jobs come and go.
            self.quota_file = {t: n for t, n in self.guaranteed_use.items() if n}


    def _submit(self, j: SimJob) -> None:
        """job_submit.lua: ``auto`` becomes guaranteed when the tenant's GPUs in the quota file plus
        this job's fit its quota, opportunistic otherwise (no quota entry: the site's auto_class,
        guaranteed). The file can be a cycle old, as on the real cluster."""
        jid = j.job.job_id
        if j.requested == "auto":
            q = self.quotas.get(j.job.tenant)
            within = fits_quota(q, self.quota_file.get(j.job.tenant, 0), j.job.gpus)
            j.klass = j.submitted_as = "guaranteed" if within else "opportunistic"
        if self._array_submit(j):  # elastic across nodes: its tasks are queued, not it (elastic_array.py)
            return
        self.active[jid] = j
        self.n_pending += 1
        self._enqueue(j)  # into its partition's queue: the class decides which
        self._count_guaranteed(j, +1)
    def _count_guaranteed(self, j: SimJob, sign: int) -> None:
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

    def _start(self, j: SimJob, gpus: list[int]) -> None:
        # Progress begins after the job's start-up (interpreter, framework, first batch), which holds
        # the GPUs but is not throttled: the agent only acts from the first boundary on.
        j.state, j.gpus, j.start, j.t_last, j.view = "RUNNING", gpus, self.now, self.now + self.cfg.start_overhead_s, None
        j.locality = self._locality(j, gpus)
        # The elastic hold counts from the last width change; a narrow start (elastic.py) is one.
        j.width_changed_at = self.now if len(gpus) < j.job.gpus else float("-inf")
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
                    self._push(g.measured_at, MEASURED, j.job.job_id, i)
            else:
                g.opp.append(j.job.job_id)
                self.node_opp[g.node] += 1
            if j.klass == "guaranteed" or self.cfg.policy in WHOLE_GPU:
                self.free_gpus.discard(i)
                self.free_by_node = None
        if self.cfg.policy == "shared" and self._oom_on(gpus):
            self._stop(j, "oom")
            return
        self._refresh(gpus)
        if j.array is not None:
            self._task_started(j)

    def _hold(self, j: SimJob, n: int) -> None:
        t = j.job.tenant
        self.tenant_gpus[t] = self.tenant_gpus.get(t, 0) + n
        if self._is_high(j):
            self.high_gpus[t] = self.high_gpus.get(t, 0) + n
        q = self.quotas.get(t)
        if n > 0 and self.cfg.policy in ("quota", "scavenger") and q is not None and n > q and (
                self.cfg.policy == "quota" or self._is_high(j)):
            self.counts["quota_over_alone"] += 1

    def _advance(self, j: SimJob) -> None:
        if self.now > j.t_last:  # (still starting up otherwise)
            j.work_left -= j.rate * (self.now - j.t_last)
            j.t_last = self.now

    def _finish(self, j: SimJob) -> None:
        if j.tasks:
            self._array_finish(j)
            return
        self._advance(j)
        j.state, j.end = "DONE", self.now
        j.finishes += 1
        self._count_guaranteed(j, -1)
        del self.active[j.job.job_id]
        self._release(j)

    def _stop(self, j: SimJob, why: str) -> None:
        """OOM (shared) or requeue after preemption (antman): back to PENDING, work since the last
        checkpoint lost."""
        if j.array is not None:
            self._task_leaving(j)
        self._advance(j)
        if why == "oom":
            # FAILED in Slurm; back in the queue (at its end, with its class) when its user resubmits it
            # (trace_run.oom_resubmit_delay: Slurm itself does not requeue it).
            j.ooms += 1
            self.counts["oom_failures"] += 1
            j.eligible_at = self.now + oom_resubmit_delay(self.cfg.oom_retry_s, self.cfg.oom_retry_max_s, j.ooms)
            self._push(j.eligible_at, WAKE, j.job.job_id, 0)
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
                self._push(j.eligible_at, WAKE, j.job.job_id, 0)
        j.lost_gpu_s += lost_s * len(j.gpus)
        j.restarts += 1
        j.state, j.view, j.version = "PENDING", None, j.version + 1
        self._release(j)
        self._enqueue(j)
        self.n_pending += 1

    def _release(self, j: SimJob) -> None:
        jid = j.job.job_id
        if j.ran_as == "guaranteed":
            self.usage[j.job.tenant] -= len(j.gpus)
        self._hold(j, -len(j.gpus))
        self.ends.drop(jid)
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
                self.free_by_node = None
        self._elastic_release(j)
        gpus, j.gpus = j.gpus, ([] if j.state == "PENDING" else j.gpus)
        self._refresh(gpus)
        if j.state == "DONE":
            j.gpus = gpus

    # -- results ------------------------------------------------------------------------------------

    def _result(self) -> SimResult:
        from ..metrics import summarize
        rows = [{
            "job_id": j.job.job_id, "tenant": j.job.tenant, "gpus": j.job.gpus, "profile": j.profile.name,
            "class": j.ran_as or j.klass, "submitted_as": j.submitted_as, "submit_s": j.submit, "first_start_s": j.first_start, "end_s": j.end,
            "duration_s": j.duration, "restarts": j.restarts, "preemptions": j.preemptions, "ooms": j.ooms,
            "lost_gpu_s": j.lost_gpu_s, "util": round(j.util, 4), "elastic": j.elastic,
            "width_changes": j.width_changes, "array_tasks": len(j.tasks),
        } for j in self.jobs.values() if j.array is None]
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
            # so a GPU busy with two jobs that each crawl counts for little (docs/evaluation.md's useful utilisation).
            useful_util=(self.area_useful / (n * span)) if span else 0.0,
            useful_util_queued=(self.area_useful_queued / (n * self.t_queued)) if self.t_queued else None,
            queued_s=self.t_queued,
            jobs_done_twice=sum(1 for j in self.jobs.values() if j.finishes > 1),
            moves=self.counts["moves"], quota_over_alone=self.counts["quota_over_alone"],
            pauses=self.counts["pauses"], resumes=self.counts["resumes"], paused_s=self.paused_s,
            pause_cost_s=self.pause_cost_s, width_changes=self.counts["width_changes"],
            shrinks=self.counts["shrinks"], grows=self.counts["grows"], elastic_share=self.cfg.elastic_share,
            multi_gpu_whole_requeues=dict(sorted(self.whole_requeues.items())),
            elastic_arrays=self.counts["arrays"], array_shrinks=self.counts["array_shrinks"],
            array_grows=self.counts["array_grows"], array_requeues=self.counts["array_requeues"],
            array_stalls=self.counts["array_stalls"], array_idle_gpu_s=self.array_idle_gpu_s,
            array_shared_gpu_starts=self.counts["array_shared_gpu_starts"],
            array_task_requeues=self.counts["array_task_requeues"], array_host_alone=self.counts["array_host_alone"],
            utilisation=self.cfg.utilisation, util_scale=self.cfg.util_scale,
            oom_failures=self.counts["oom_failures"], upgrades=self.counts["upgrades"],
            set_class_ineffective=self.counts["set_class_ineffective"],
            coordinator_cycles=self.counts["cycles"],
            quotas=dict(self.quotas),
        )
        if self.cfg.wait_study_s is not None:
            metrics["wait_study"] = dict(self.wait_study)
        return SimResult(self.cfg.policy, metrics, rows, _downsample(self.series, self.cfg.max_samples))


def _downsample(series: list[tuple[float, float, float]], k: int) -> list[tuple[float, float, float]]:
    if len(series) <= k:
        return series
    step = len(series) / k
    return [series[int(i * step)] for i in range(k)]


def tenant_quotas(jobs: Sequence[TraceJob], gpus: int, quota_scale: float) -> dict[str, int]:
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


def simulate(jobs: Sequence[TraceJob], cfg: SimConfig) -> SimResult:
    return Simulator(jobs, cfg).run()
