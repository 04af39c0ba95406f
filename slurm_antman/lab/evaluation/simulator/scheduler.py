"""Slurm's scheduler as each policy configures it: the queue, scheduling passes, tenant quotas,
scavenger preemption and the choice of nodes and GPUs. The baselines a Slurm site would choose
between (docs/evaluation.md) are this module alone:

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
  every job on a GPU slows by the workload model's interference (``interference``); a GPU whose
  footprints exceed its memory makes the job that arrived last fail with OOM: FAILED, counted, and
  resubmitted by its user (``trace_run.oom_resubmit_delay``: a minute later, backing off to an hour).

Under ``antman`` the same scheduler starts the jobs, within the node slot counts the coordinator sets
and on the GPUs the node policy's ``choose_gpus`` picks (``antman``).

Placement and backfill, as Slurm does them (docs/workload_model.md, "Placement, backfill and locality",
lists what is left out):

- ``placement="nodes"``: a job of up to a node's GPUs runs on one node (``-N 1``, as the devcluster
  replay submits it) or waits; a larger one on ``ceil(g / gpus_per_node)`` nodes, its GPUs split as
  evenly as they go (``-N n --gpus=g``). Among nodes that fit, the one with the fewest free GPUs
  (select/cons_tres's best fit), lowest index first; a multi-node job under one leaf switch when one
  has room (topology/tree).
- ``backfill="easy"``: whole GPUs are given in submission order (priority/basic). The first job that
  cannot start gets a reservation: the earliest time the running jobs' ends free enough GPUs for it,
  within ``bf_window_s`` (Slurm's bf_window). A later job starts only on GPUs that reservation does not
  need, or if it ends before the reservation begins. Slurm's sched/backfill reserves for each of the
  first 500 jobs (bf_max_job_test), every 30 s (bf_interval), from the jobs' time limits; here there
  is one reservation, it is planned at every pass, and from the jobs' true remaining run times. Each
  of these makes the baselines' backfill at least as good as Slurm's, never worse.
- Opportunistic jobs hold no whole GPU (antman's count-only GRES, shared's shards) and have a
  partition of their own (job_submit.lua's opp_partition): no reservation keeps them off a GPU, and
  they start in submission order wherever they fit.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from operator import itemgetter
from typing import Iterable, Iterator, Optional

from slurm_antman.policy.cluster.quota import fits_quota

from ..locality_data import profile_efficiency
from .backfill import BackfillPlan, EasyBackfill, split
from .config import WHOLE_GPU
from .opp_place import OpportunisticPlacement
from .state import REQUEUE, WAKE, Reservation, SimJob


_ticket = itemgetter(1)  # a queue entry's (job, ticket) ticket


class SlurmScheduler(EasyBackfill, OpportunisticPlacement):
    """The scheduler's half of ``Simulator``: it works on the simulator's state (``engine``)."""

    drop_queues = True  # a pass steps over the queued jobs that can no longer start (tests turn it off)
    queues_dropped = 0  # (how often, in this process)

    def _enqueue(self, j: SimJob) -> None:
        self.seq += 1
        j.ticket = self.seq
        j.queued_at = self.now
        if self._switch_wait(j):  # a pass when its wait for one switch is over
            self._push(self.now + self.cfg.switch_wait_s, WAKE, j.job.job_id, 0)
        entry = (j.job.job_id, j.ticket)
        key = self._queue_key(j)
        self.queues.setdefault(key, []).append(entry)
        self.queue_ests.setdefault(key, []).append(self._run_estimate(j))  # (its work does not change while it waits)
        self.fresh.append(entry)
        # What a pass's ``skip_to`` needs to know of a queue's rest: where its guaranteed jobs are,
        # and whether an elastic job is still in it.
        if j.klass == "guaranteed":
            self.queue_guaranteed.setdefault(key, []).append(j.ticket)
        if j.elastic:
            self.queue_last_elastic[key] = j.ticket

    def _queue_key(self, j: SimJob) -> tuple[bool, str, int]:
        return self.cfg.policy == "scavenger" and self._is_high(j), j.job.tenant, j.job.gpus

    def _queued(self, entry: tuple[str, int]) -> bool:
        j = self.jobs[entry[0]]
        return j.ticket == entry[1] and j.state == "PENDING"

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
                self._schedule_pass(queue(None), keep_resv=only_fresh)
            return
        # Slurm schedules the higher-priority partition first, and preempts for what is left of it.
        if self.free_gpus:
            self._schedule_pass(queue(True), keep_resv=only_fresh)
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
        empty = []
        for key, q in self.queues.items():
            if high is not None and key[0] != high:
                continue
            if self.dead.get(key, 0) * 2 > len(q):
                ests = self.queue_ests[key]
                live = [k for k, e in enumerate(q) if self._queued(e)]
                q = self.queues[key] = [q[k] for k in live]
                self.queue_ests[key] = [ests[k] for k in live]
                self.dead[key] = self.heads[key] = 0
            h = self.heads.get(key, 0)
            while h < len(q) and not self._queued(q[h]):
                h += 1
            self.heads[key] = h
            if h >= len(q):
                empty.append(key)
            elif not self._at_quota(key):
                heap.append((q[h][1], key, h))
        for key in empty:  # every entry left: gone until a job of its kind queues again (_enqueue)
            del self.queues[key]
            del self.queue_ests[key]
            self.heads.pop(key, None)
            self.dead.pop(key, None)
        heapq.heapify(heap)
        while heap:
            _, key, i = heapq.heappop(heap)
            q = self.queues[key]
            yield q[i]
            # Only the tenant whose job was just looked at can have reached its quota since; and a
            # pass may know by now that none, or only the guaranteed, of this queue's rest can start
            # (``skip_to`` in ``_schedule_pass``).
            if i + 1 < len(q) and not self._at_quota(key):
                k = i + 1 if self.skip_to is None else self.skip_to(key, i + 1)
                if k is None:
                    SlurmScheduler.queues_dropped += 1
                elif k < len(q):
                    heapq.heappush(heap, (q[k][1], key, k))

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

    def _is_high(self, j: SimJob) -> bool:
        return j.submitted_as == "guaranteed"

    def _within_quota(self, j: SimJob) -> bool:
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

    def _schedule_pass(self, ids: Iterable[tuple[str, int]], budget: Optional[int] = None,
                       keep_resv: bool = False) -> None:
        """Start what fits, in queue order; ``budget``: at most this many GPUs in all (scavenger's low
        partition, which backfill does not plan for: its jobs are preempted instead). ``keep_resv``:
        only jobs queued since the last pass are looked at, and nothing was freed since, so the last
        pass's reservation still holds."""
        whole = self.cfg.policy in WHOLE_GPU
        easy = self.cfg.backfill == "easy" and budget is None
        resv = self.resv if keep_resv and easy else None
        if not keep_resv:
            self.resv = None
        # Nothing changes between placements, so a job no smaller than one that did not fit on as many
        # nodes cannot fit (a reservation only takes room away, so failures before it count alone);
        # likewise per tenant for its quota (its GPUs only grow during a pass).
        smallest_failed: dict[tuple[str, int], int] = {}
        over_quota: dict[str, int] = {}
        host_first = self.cfg.elastic_array_host_first
        plan: Optional[BackfillPlan] = None  # the running jobs' ends, for reservations until a start

        reserved_here = False  # the reservation is for a job this pass looked at already
        cfg = self.cfg
        switch_waits = cfg.policy == "antman" and cfg.nodes_per_switch > 0 and cfg.switch_wait_s is not None

        def failed(key: tuple) -> int:
            return smallest_failed.get(key, 1 << 30)

        def skip_to(key: tuple[bool, str, int], i: int) -> Optional[int]:
            """The first entry from ``i`` on of queue ``key`` that may still start in this pass, so that
            ``_in_order`` steps over the rest: None when none can. A job is stepped over when it would
            fail as one no smaller of its shape failed already, and would change nothing in failing.
            Its tenant and size are the queue's; its class, elasticity and switch wait make the rest of
            its shape, and every one it may have must have failed. Failing changes nothing: with a
            reservation held none is planned, and without one a job of its shape and no more GPUs
            found none, so it would find none either (a plan's answer only gets later with more GPUs a
            node). A pending job's class and elasticity do not change while it waits."""
            if resv is not None and not reserved_here:
                return i  # the last pass's reservation, which a job of this pass may still start
            g = key[2]
            if (budget is not None and g > budget) or g >= over_quota.get(key[1], 1 << 30):
                return None  # more GPUs than the pass has left to give, or than its tenant's quota lets it
            n = self._nodes_for(g)
            q = self.queues[key]
            ticket = q[i][1]
            guaranteed = self.queue_guaranteed.get(key)
            guaranteed_left = whole or (guaranteed is not None and ticket <= guaranteed[-1])
            guaranteed_fail = not guaranteed_left or failed(("guaranteed", n, False, False, False)) <= g
            if whole:
                if guaranteed_fail:
                    return None
                if resv is None or failed(("guaranteed", n, False, False, True)) > g:
                    return i
                # Those that would still run when the reservation begins fail (its own job was looked
                # at already): on to the next that ends before it (_after_reservation, as it reckons).
                ests, now, start, k = self.queue_ests[key], self.now, resv.start, i
                while k < len(q) and now + ests[k] > start:
                    k += 1
                return k if k < len(q) else None
            elastic = (False, True) if ticket <= self.queue_last_elastic.get(key, -1) else (False,)
            waits = (False, True) if switch_waits and n > 1 else (False,)
            for w in waits:  # (every shape its rest may have failed already)
                for e in elastic:
                    if smallest_failed.get(("opportunistic", n, w, e, False), 1 << 30) > g:
                        return i
            if guaranteed_fail:
                return None
            # only its guaranteed jobs may start: on to the next of them
            nxt = guaranteed[bisect_left(guaranteed, ticket)]
            return bisect_left(q, nxt, lo=i, key=_ticket)

        self.skip_to = skip_to if self.drop_queues else None  # (read by _in_order: ids may be its generator)
        try:
            for jid, ticket in ids:
                j = self.jobs[jid]
                if j.state != "PENDING" or j.ticket != ticket or j.held or j.eligible_at > self.now:
                    continue
                if host_first and j.array is not None and j.task != 0 and \
                        self.jobs[self.jobs[j.array].tasks[0]].state != "RUNNING":
                    continue  # held while its array's rendezvous host is pending
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
                # Within a pass room only shrinks, so a job no smaller than one that failed with the same
                # shape (nodes, switch wait, elasticity, and whether the reservation's GPUs are closed to
                # it) fails too.
                late = kind == "guaranteed" and self._after_reservation(j, resv)
                key = (kind, self._nodes_for(j.job.gpus), self._switch_wait(j), j.elastic, late)
                gpus = None if j.job.gpus >= smallest_failed.get(key, 1 << 30) else self._place(j, resv)
                if gpus is None:
                    smallest_failed[key] = min(smallest_failed.get(key, 1 << 30), j.job.gpus)
                    if resv is None and kind == "guaranteed" and easy:
                        # (also in a pass over fresh jobs: the last full pass reserved for nobody)
                        resv, plan = self._reserve(j, plan)
                        self.resv, reserved_here = resv, True
                    # (only a 1-GPU failure can make it so)
                    if j.job.gpus <= 1 and self._nothing_fits(smallest_failed, "guaranteed", resv) and (
                            whole or self._nothing_fits(smallest_failed, "opportunistic", None)):
                        break  # not even a 1-GPU job fits: the rest waits
                    continue
                if resv is not None and resv.job_id == jid:
                    resv = self.resv = None
                self._start(j, gpus)
                plan = None  # the running jobs changed
                if budget is not None:
                    budget -= len(gpus)
        finally:
            self.skip_to = None

    @staticmethod
    def _nothing_fits(smallest_failed: dict, kind: str, resv: Optional[Reservation]) -> bool:
        """A 1-GPU job of this kind failed, both ending before the reservation and after it."""
        return all(smallest_failed.get((kind, 1, False, False, late), 1 << 30) <= 1
                   for late in ((False, True) if resv is not None and kind == "guaranteed" else (False,)))

    def _preempt_scavengers(self, high: Iterable[tuple[str, int]]) -> int:
        """Slurm's preempt/partition_prio: a high job that is eligible and within quota but finds too
        few idle GPUs has scavenger jobs signalled (the youngest first, so the least work is lost);
        they are requeued when the grace time is over (``REQUEUE``). GPUs already being freed count.
        Returns how many idle GPUs no waiting high job claims."""
        free = len(self.free_gpus)
        freeing: Optional[int] = None  # counted at the first job that needs more than is idle
        victims: Optional[list[SimJob]] = None
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
                self._push(self.now + self.cfg.grace_s, REQUEUE, v.job.job_id, v.restarts)
                deficit -= len(v.gpus)
            freeing += max(0, -deficit)
            if deficit > 0:
                return 0  # nothing left to preempt
        return free

    # -- placement --------------------------------------------------------------------------------

    def _nodes_for(self, gpus: int) -> int:
        if self.cfg.placement == "spread":
            return 1
        return -(-gpus // self.cfg.gpus_per_node)

    def _switch_of(self, node: int) -> int:
        n = self.cfg.nodes_per_switch
        return node // n if n > 0 else 0

    def _switch_wait(self, j: SimJob) -> bool:
        """An antman opportunistic multi-node job still inside its wait for one switch."""
        cfg = self.cfg
        return (cfg.policy == "antman" and j.klass == "opportunistic" and cfg.nodes_per_switch > 0
                and cfg.switch_wait_s is not None and self._nodes_for(j.job.gpus) > 1
                and self.now < j.queued_at + cfg.switch_wait_s)

    def _pick_nodes(self, avail: dict[int, int], counts: list[int], one_switch: bool) -> Optional[list[int]]:
        """The nodes for a job of ``counts`` GPUs a node, best fit (fewest available first), under one
        leaf switch when one has room (required if ``one_switch``)."""
        need = counts[0]
        if len(counts) == 1:  # the best fit alone: no need to sort them all
            best = min(((a, n) for n, a in avail.items() if a >= need), default=None)
            return None if best is None else [best[1]]
        fit = sorted((n for n, a in avail.items() if a >= need), key=lambda n: (avail[n], n))
        if len(fit) < len(counts):
            return None
        groups: dict[int, list[int]] = {}
        for n in fit:
            groups.setdefault(self._switch_of(n), []).append(n)
        ok = [g for g in groups.values() if len(g) >= len(counts)]
        if ok:
            # topology/tree's best fit among switches: the one with the fewest nodes that fit
            return min(ok, key=lambda g: (len(g), g[0]))[:len(counts)]
        return None if one_switch else fit[:len(counts)]

    def _run_estimate(self, j: SimJob) -> float:
        """Backfill's view of how long a job runs: its true remaining work (perfect time limits, the
        best case for backfill) and its start-up."""
        return max(j.work_left, 0.0) + self.cfg.start_overhead_s

    def _place(self, j: SimJob, resv: Optional[Reservation] = None) -> Optional[list[int]]:
        # job_submit.lua keeps an elastic job, and each task of an elastic array, on one node (elastic.py,
        # elastic_array.py), whatever the placement model.
        one_node = (j.elastic and j.klass == "opportunistic" and self.cfg.policy == "antman") or j.array is not None
        if self.cfg.placement == "spread" and not one_node:
            return self._place_spread(j)
        want = j.job.gpus
        counts = split(want, self._nodes_for(want))
        if j.klass == "guaranteed" or self.cfg.policy in WHOLE_GPU:
            if len(self.free_gpus) < want:
                return None
            return self._pack_nodes(j, counts, resv)
        return self._place_opportunistic(j, counts)

    def _free_by_node(self) -> dict[int, list[int]]:
        """The free GPUs by node, in the order a job takes them; kept until free_gpus changes (a pass
        over a long queue asks for it once per job)."""
        by_node = self.free_by_node
        if by_node is None:
            by_node = {}
            for i in sorted(self.free_gpus):
                by_node.setdefault(self.gpus[i].node, []).append(i)
            if self.cfg.policy == "shared":  # beside as few opportunistic jobs as it can
                for lst in by_node.values():
                    lst.sort(key=lambda i: (len(self.gpus[i].opp), i))
            self.free_by_node = by_node
        return by_node

    def _after_reservation(self, j: SimJob, resv: Optional[Reservation]) -> bool:
        """Whether ``j`` would still run when the reservation begins: then it may not use its GPUs."""
        return resv is not None and resv.job_id != j.job.job_id and self.now + self._run_estimate(j) > resv.start

    def _pack_nodes(self, j: SimJob, counts: list[int], resv: Optional[Reservation]) -> Optional[list[int]]:
        by_node = self._free_by_node()
        avail = {n: len(lst) for n, lst in by_node.items()}
        if self._after_reservation(j, resv):
            for n, k in resv.count.items():
                if n in avail:
                    avail[n] -= k
        nodes = self._pick_nodes(avail, counts, one_switch=False)
        if nodes is None:
            return None
        return [i for n, c in zip(nodes, counts) for i in by_node[n][:c]]

    def _locality(self, j: SimJob, gpus: list[int]) -> float:
        nodes = len({self.gpus[i].node for i in gpus})
        if nodes <= 1 or not self.cfg.locality:
            return 1.0
        return profile_efficiency(j.profile.name, len(gpus), nodes)

    # -- the model until 2026-11-26 (placement="spread"), kept to say how the baselines moved -----

    def _place_spread(self, j: SimJob) -> Optional[list[int]]:
        want = j.job.gpus
        if j.klass == "guaranteed" or self.cfg.policy in WHOLE_GPU:
            if len(self.free_gpus) < want:
                return None
            return self._pack(sorted(self.free_gpus), want, prefer_empty=self.cfg.policy == "shared")
        chosen: list[int] = []
        wait = self._waits_for_room(j)
        for k in range(self.cfg.nodes):
            if len(chosen) >= want:
                break
            chosen.extend(self._opp_pick(j, k, want - len(chosen), wait))
        return chosen if len(chosen) >= want else None

    def _pack(self, free: list[int], want: int, prefer_empty: bool) -> list[int]:
        """The spread model's choice: fill the node with the fewest free GPUs that still fits, lowest
        indices first; else whole nodes first, across as many as it takes."""
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
