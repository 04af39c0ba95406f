"""The ``antman`` policy: the production policy code driven on the simulated cluster.

The cluster policy core (``slurm_antman.policy.cluster.decide``) resolves classes by tenant quota,
sets each node's opportunistic slot count, upgrades and preempts; the node-local policy
(``slurm_antman.policy.node.core.decide``) sets memory limits, compute shares and raises preemption
needs; ``slurm_antman.policy.node.placement.choose_gpus`` picks the GPU of an opportunistic job
(``scheduler``).

Speed: at most one coordinator cycle per batch of events at one instant and per ``cycle_s``; a cycle
sees only active jobs, with running guaranteed jobs summed per tenant (docs/evaluation.md).

The compute share an opportunistic job gets is the steady state of the local policy's AIMD loop,
found by running ``policy.node.core.decide`` on the modelled iteration times of the GPU's guaranteed job
(cached per combination of profiles: the loop converges in seconds, jobs run for minutes to days).
See docs/workload_model.md for the formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Collection, Iterable, Mapping

from slurm_antman.policy import cluster as cp
from slurm_antman.policy.cluster import moves as cp_moves
from slurm_antman.policy.cluster import preemption as cp_preemption
from slurm_antman.policy.node import core as lp

from .state import PAUSE_CHECK, SLOW, WAKE, SimGpu, SimJob

# The AIMD loop's steady state (``Simulator._steady_shares``) is a smooth function of the interference
# curve's two numbers (a, q) (``workloads.Profile.share_curve``), which production utilisation makes
# continuous: each distinct curve costs 120 runs of the local policy, and a third of antman's simulation
# time went to them when every one was run. Both are taken on a logarithmic grid of 5 % steps (within
# 2.5 %; the steady share is a staircase that halves with the AIMD decrease), and the steady states are
# kept for the process: a run needs a few hundred of them.
_C_STEP = 0.05
_C_MIN = 1e-4  # below: no measurable interference
_Q_MAX = 0.999  # the curve's pole: a share this close to it reads as a slowdown of 1,000x
_SHARE_CACHE: dict[tuple, tuple[float, bool]] = {}
_ALONE_CACHE: dict[lp.NodePolicyParams, lp.PolicyState] = {}  # per params: measured_alone of the curve loop
# The reports the steady state is found from: 0.5 s (torch_patch's REPORT_MAX_GAP_S) of 100 ms
# mini-batches each, so that the loop decides every slowdown_window reports (NodePolicyParams).
REPORT_S, PER_REPORT = 0.5, 5


def _c_grid(c: float) -> float:
    if c < _C_MIN:
        return 0.0
    return math.exp(round(math.log(c) / _C_STEP) * _C_STEP)


def curve_slowdown(a: float, q: float, share: float) -> float:
    """The guaranteed job's slowdown at ``share`` on the curve (a, q) (workloads.Profile.share_curve)."""
    return 1.0 - a + a / (1.0 - min(_Q_MAX, share * q))


@dataclass(frozen=True, slots=True)
class _Jobs:
    """The one field of a snapshot the coordinator's quota-file writer reads."""

    jobs: tuple[cp.JobView, ...]


class AntmanAdapter:
    """The production policies' half of ``Simulator``: it works on the simulator's state (``engine``)."""

    # -- the node-local policy on each GPU ----------------------------------------------------------

    def _local_policy(self, g: SimGpu, guar: list[SimJob], opp: list[SimJob]) -> tuple[dict[str, float], set[str]]:
        """Memory limits and preemption needs from ``policy.node.core.decide`` on this GPU; compute
        shares from its AIMD loop's steady state for this mix of profiles."""
        info = lp.GpuInfo(0, g.mem_total)
        can_pause = self.lp_params.pause_max_s is not None
        js = [lp.JobInfo(j.job.job_id, "guaranteed", (0,), j.start or 0.0, j.profile.mem_bytes) for j in guar]
        js += [lp.JobInfo(j.job.job_id, "opportunistic", (0,), j.start or 0.0, j.profile.mem_bytes,
                          can_pause=can_pause) for j in opp]
        before = g.lp_state.paused
        d = lp.decide(lp.NodeSnapshot((info,), tuple(js)), g.lp_state, self.lp_params, self.now)
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
            # All opportunistic jobs on a GPU get the same share; the guaranteed job then slows along
            # one curve of the share (workloads module doc), so the AIMD loop's steady state depends on
            # the curve's two numbers alone.
            a, q = guar[0].profile.share_curve(((o.profile.kind, o.duty) for o in opp), guar[0].duty)
            steady, slow = self._steady_shares(_c_grid(a), _c_grid(q), len(opp))
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

    def _pauses_changed(self, g: SimGpu, before: Mapping[str, lp.PauseRecord], d: lp.Decision) -> None:
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
                self._push(t, PAUSE_CHECK, rec.job_id, g.index)

    def _track_slow(self, g: SimGpu, guar: list[SimJob], slow: bool) -> None:
        """The local policy's preemption for speed: a GPU whose mix stays over target at the floor
        asks the coordinator for room ``slow_preempt_s`` later (``_cycle`` raises the need)."""
        wait = self.lp_params.slow_preempt_s
        if not (slow and guar and wait is not None):
            g.slow_since = None
            self.slow_gpus.discard(g.index)
        elif g.slow_since is None:
            g.slow_since = self.now
            self.slow_gpus.add(g.index)
            self._push(self.now + wait, SLOW, guar[0].job.job_id, 0)

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

    def _steady_shares(self, a: float, q: float, n: int) -> tuple[float, bool]:
        """The mean compute share of each of ``n`` opportunistic jobs beside a guaranteed job that
        slows along the curve (a, q) (``curve_slowdown``), over the last half of 120 reports of
        ``policy.node.core.decide``, and whether the guaranteed job ends over target at the floor share
        (its slow_preempt_s rule)."""
        key = (self.lp_params, a, q, n)
        hit = _SHARE_CACHE.get(key)
        if hit is not None:
            return hit
        base_ms = 100.0  # only ratios to it matter
        gjob = lp.JobInfo("g", "guaranteed", (0,), 0.0, 0)
        ojobs = tuple(lp.JobInfo(f"o{k}", "opportunistic", (0,), 1.0 + k, 0) for k in range(n))
        info = (lp.GpuInfo(0, 1 << 50),)
        # The baseline first: the solo reports the sidecar has before the opportunistic job arrives,
        # or takes in the probe that holds it when the guaranteed job arrives second
        # (NodePolicyParams.probe_share). The probe's seconds are not modelled (docs/workload_model.md).
        state = _ALONE_CACHE.get(self.lp_params)
        if state is None:  # (the same for every curve: decide is pure and its states immutable)
            state = _ALONE_CACHE[self.lp_params] = lp.measured_alone(replace(gjob, iteration_ms=base_ms), info[0],
                                                                     self.lp_params)
        history: list[float] = []
        share = self.lp_params.initial_share
        # A report every REPORT_S of PER_REPORT mini-batches, as an agent's at its longest gap.
        for k in range(1, 121):
            # (gjob with a report: built directly, dataclasses.replace costs as much again)
            rep = lp.JobInfo("g", "guaranteed", (0,), 0.0, 0, k * PER_REPORT, base_ms * curve_slowdown(a, q, share))
            d = lp.decide(lp.NodeSnapshot(info, (rep,) + ojobs), state, self.lp_params, k * REPORT_S)
            state = d.state
            share = d.limits["o0"].compute_share
            history.append(share)
        tail = history[-60:]
        out = (sum(tail) / len(tail), bool(state.over_since))
        _SHARE_CACHE[key] = out
        return out

    def _track_crawl(self, g: SimGpu, guar: list[SimJob], opp: list[SimJob]) -> None:
        """The local policy's crawling rule on the modelled progress (each job's rate on this GPU);
        a cycle is due when a crawler's ``move_after_s`` is over. A task of an elastic array that waits
        for its training (elastic_array.py) reports no progress."""
        opp = [j for j in opp if j.array is None or self.jobs[j.array].state == "RUNNING"]
        # As the sidecar measures it: each job's pace on this GPU, an elastic job's scaled by its width
        # (policy.node.core: "An elastic job below its width ..."), which the real node knows as a
        # fraction of GPUs, not through the profile's scaling curve.
        g.progress = {j.job.job_id: g.rate[j.job.job_id] * (len(j.gpus) / j.job.gpus if j.elastic else 1.0)
                      for j in opp}
        order = {0: [j.job.job_id for j in sorted(opp, key=lambda j: (j.start or 0.0, j.job.job_id))]}
        before = g.crawl
        narrowed = [j.job.job_id for j in opp if j.elastic and len(j.gpus) < j.job.gpus]
        g.crawl = lp.crawling(g.progress, order, {0} if guar else set(), before, self.now, self.lp_params, narrowed)
        wait = self.cfg.move_after_s
        if g.crawl:
            self.crawl_gpus.add(g.index)
            if wait is not None:
                for jid, since in g.crawl.items():
                    if jid not in before:
                        self._push(since + wait, SLOW, jid, 0)
        else:
            self.crawl_gpus.discard(g.index)

    # -- the coordinator cycle --------------------------------------------------------------------

    @staticmethod
    def _quota_use(views: Iterable[cp.JobView]) -> dict[str, int]:
        from slurm_antman.coordinator.daemon import quota_use
        return quota_use(_Jobs(tuple(views)))

    def _view(self, j: SimJob) -> cp.JobView:
        if j.view is None:
            node = self.node_names[self.gpus[j.gpus[0]].node] if j.state == "RUNNING" and j.gpus else None
            ckpt = None
            if j.state == "RUNNING" and j.start is not None:
                ckpt = j.start + math.floor((self.now - j.start) / self.cfg.checkpoint_s) * self.cfg.checkpoint_s
            j.view = cp.JobView(j.job.job_id, j.job.tenant, "u", j.state, j.requested, j.klass, j.job.gpus, node,
                                j.submit, j.start if j.state == "RUNNING" else None, j.restarts,
                                ckpt if ckpt and ckpt > (j.start or 0) else None, j.held,
                                # a task of an elastic array: its array, and whether it hosts the rendezvous
                                elastic_group=j.array or "", elastic_host=j.array is not None and j.task == 0)
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
                out.append(j.view or self._view(j))
        summed = self.tenant_views
        for tenant, n in held_gpus.items():
            v = summed.get((tenant, n))
            if v is None:  # (immutable: one per tenant and sum for the whole run)
                v = summed[tenant, n] = cp.JobView(f"running-guaranteed:{tenant}", tenant, "u", "RUNNING", "guaranteed",
                                                   "guaranteed", n, None, 0.0, 0.0, 0, None, False)
            out.append(v)
        return tuple(out)

    def _node_views_for(self, nodes: Iterable[int]) -> tuple[cp.NodeView, ...]:
        """The views of ``nodes`` as a cycle sees them. A GPU changes only through _refresh, which
        marks its node dirty: a clean node's GPU views, and its best move target, are reused (a
        cluster of 500 GPUs has hundreds of clean ones)."""
        out = []
        per = self.cfg.gpus_per_node
        for k in nodes:
            gv = self.gpu_views.get(k)
            fresh = gv is None or k in self.dirty_nodes
            if fresh:
                gv = self.gpu_views[k] = tuple(
                    cp.GpuView(g.local, g.mem_total, g.mem_used, g.util, tuple(g.guar), tuple(g.opp),
                               tuple(g.progress.items()), tuple(g.crawl.items()), self.now >= g.measured_at)
                    for g in self.gpus[k * per:(k + 1) * per])
            view = cp.NodeView(self.node_names[k], gv, self.cfg.slots_per_gpu * per, self.opp_slots[k], self.now)
            if fresh and self.cfg.move_after_s is not None:
                self.best_target[k] = cp_moves.best_target(view, self.cp_params)
            out.append(view)
        return tuple(out)

    def _cycle(self) -> None:
        self._slow_needs()
        self._elastic_before_cycle()
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
        if wait is not None:
            # A move looks for a better GPU anywhere: the snapshot holds the due crawlers' nodes and
            # every node with a GPU that promises one of them enough (policy.cluster.moves.move_floor).
            # A node left out has none (its best_target, kept while its views are), so the moves are
            # those of a snapshot of every node. A crawler under notice already sets no floor: this
            # cycle's preemption step keeps it preempting or requeues it, and the moves step passes it by.
            floor = math.inf
            notices = self.cp_state.preempting
            for i in self.crawl_gpus:
                g = self.gpus[i]
                for jid, since in g.crawl.items():
                    if self.now - since >= wait:
                        nodes.add(g.node)
                        p = notices.get(jid)
                        j = self.jobs[jid]
                        if p is None or not cp_preemption.notice_stands(p, j.restarts, j.state, j.klass):
                            floor = min(floor, cp_moves.move_floor(g.progress.get(jid, 0.0), self.cp_params))
            if floor < math.inf:  # (a dirty node's best is stale, but it is in the snapshot already)
                best = self.best_target
                nodes.update(k for k in range(self.cfg.nodes) if best[k] >= floor)
        snap = cp.Snapshot(self.now, views, self._node_views_for(sorted(nodes)), self.quotas, needs)
        self.dirty_nodes = set()
        decisions, self.cp_state, no_room = cp.decide_with_room(snap, st, self.cp_params)
        # Slurm's opportunistic count never follows the room (policy.cluster.placement): the nodes without
        # room are kept off, which the simulator models as nothing starting there.
        no_room_here = {self.node_index[n] for n in no_room}
        for n in snap.nodes:
            k = self.node_index[n.name]
            if (k in no_room_here) != (k in self.no_room_nodes):
                self._room_changed(k)  # (opp_place.py)
                if k in no_room_here:
                    self.no_room_nodes.add(k)
                else:
                    self.no_room_nodes.discard(k)
        per, now = self.cfg.gpus_per_node, self.now
        for jid, a in self.cp_state.avoid.items():
            # (an entry lasts while its job does: those of earlier cycles are on their jobs already)
            if a.since_unix == now:
                j = self.jobs.get(jid)
                if j is not None:
                    j.avoid = (self.node_index[a.node] * per + a.gpu,)
        for d in decisions:
            self._apply(d)
            if d.kind == "preempt_notice":  # wake the coordinator when the grace time is over
                self._push(self.now + d.grace_s, WAKE, d.job_id, 0)
        # What the decisions changed (slots, classes, holds) is for the next cycle to see; a pending
        # preemption or requeue needs the next cycle too.
        st = self.cp_state
        if decisions or self.dirty_nodes or st.preempting or any(not r.made_eligible for r in st.requeued.values()):
            self.changed = True

    def _whole_requeue_cause(self, j: SimJob, move: bool) -> str:
        """Why a multi-GPU job is requeued whole rather than narrowed (the target is width changes
        in place of whole-job requeues): ``need``: a guaranteed job's need; for a move, ``rigid`` (not
        elastic: wider than a node, or not submitted elastic), ``all_shared`` (every GPU it runs on has
        a guaranteed job, so giving one up leaves it crawling on the rest), ``narrowed`` (no guaranteed
        neighbour: moved to run at its full width again, nothing of its own set being free to grow
        into) or ``some_shared`` (where giving up the shared GPUs might have done)."""
        if not move:
            return "need"
        if not j.elastic:
            return "rigid"
        shared = sum(1 for i in j.gpus if self.gpus[i].guar)
        if shared == len(j.gpus):
            return "all_shared"
        return "narrowed" if shared == 0 else "some_shared"

    def _apply(self, d: cp.Decision) -> None:
        kind = d.kind
        if kind == "set_opp_slots":  # a count put back to slurm.conf's: the simulator's never changes
            self.opp_slots[self.node_index[d.node]] = d.slots
            self._room_changed(self.node_index[d.node])
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
        elif kind == "upgrade" and j.state == "RUNNING" and j.array is None:
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
                    self.free_by_node = None
            self._elastic_release(j)  # a guaranteed job holds the GPUs it runs on, no shed slot
            self._refresh(j.gpus)
        elif kind == "requeue" and j.state == "RUNNING":
            self._stop(j, "preempt")
        elif kind == "preempt_notice" and j.state == "RUNNING":
            j.notice_at = self.now
            if d.inputs.get("move"):
                self.counts["moves"] += 1
            if j.job.gpus > 1 and j.array is None:
                cause = self._whole_requeue_cause(j, bool(d.inputs.get("move")))
                self.whole_requeues[cause] = self.whole_requeues.get(cause, 0) + 1
        elif kind == "checkpoint_notice" and j.array is not None:
            self._task_checkpoint(j, self.now + d.at_s)  # elastic_array.py
        elif kind == "make_eligible" and j.array is not None:
            self._task_eligible(j, d.start_unix)  # a task's hold (elastic_array.py)
        # make_eligible of any other job: the simulated Slurm has no BeginTime wait to clear.

