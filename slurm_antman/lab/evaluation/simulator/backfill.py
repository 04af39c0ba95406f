"""EASY backfill's reservation, planned once per state instead of once per waiting job.

A pass over a long queue asks for a reservation at every whole-GPU job that cannot start as long as
none is held (``scheduler._schedule_pass``): when the first such job's reservation lies beyond
bf_window, the next one asks again, and so on down the queue. Each answer walks the running jobs'
ends in time order until enough GPUs are free. Between two starts of one pass nothing those ends
depend on changes (the same instant, the same running jobs at the same rates), so the ends are
gathered and sorted once (``BackfillPlan``) and each shape of job (its GPUs per node) is walked once;
a start drops the plan. The answers are those of planning from scratch for every job, to the bit
(tests/test_simulator_backfill.py checks it on random cases).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from .config import WHOLE_GPU
from .state import Reservation, SimJob

def split(want: int, nodes: int) -> list[int]:
    """``want`` GPUs over ``nodes`` nodes as evenly as they go, larger parts first (12 over 2: [6, 6];
    20 over 3: [7, 7, 6]): how select/cons_tres spreads ``--gpus=g -N n``."""
    base, extra = divmod(want, nodes)
    return [base + 1] * extra + [base] * (nodes - extra)


# (GPUs available per node, GPUs per node the job needs) -> the nodes chosen, or None
PickNodes = Callable[[dict[int, int], list[int]], Optional[list[int]]]


class BackfillPlan:
    """The idle GPUs per node and the running jobs' ends, ``(time, node, GPUs freed there)`` sorted,
    at one instant; the earliest start found per job shape."""

    def __init__(self, free: dict[int, int], ends: list[tuple[float, int, int]], horizon: float, now: float):
        self.free = free
        self.ends = sorted(ends)
        self.horizon = horizon
        self.now = now
        self.found: dict[tuple[int, ...], Optional[tuple[float, list[int]]]] = {}

    def earliest(self, counts: list[int], pick: PickNodes) -> Optional[tuple[float, list[int]]]:
        """The earliest time, within the horizon, at which ``pick`` finds nodes for ``counts``, and
        those nodes; None beyond the horizon. Every end at one instant is counted before looking again."""
        key = tuple(counts)
        if key in self.found:
            return self.found[key]
        free = dict(self.free)
        ends = self.ends
        t, k, out = self.now, 0, None
        while True:
            nodes = pick(free, counts)
            if nodes is not None:
                out = (t, nodes)
                break
            if k >= len(ends):
                break
            t = ends[k][0]
            if t > self.horizon:
                break
            while k < len(ends) and ends[k][0] == t:
                free[ends[k][1]] = free.get(ends[k][1], 0) + ends[k][2]
                k += 1
        self.found[key] = out
        return out


class EasyBackfill:
    """The reservation's half of ``SlurmScheduler``: it works on the simulator's state (``engine``)."""

    def _reserve(self, j: SimJob, plan: Optional[BackfillPlan]) -> tuple[Optional[Reservation], BackfillPlan]:
        """The earliest time, within bf_window, at which the running jobs' ends leave room for ``j``,
        and the GPUs it would take then (None beyond the window); and the plan it was read from, valid
        until the next start (backfill.py)."""
        if plan is None:
            plan = self._backfill_plan()
        counts = split(j.job.gpus, self._nodes_for(j.job.gpus))
        found = plan.earliest(counts, lambda free, c: self._pick_nodes(free, c, one_switch=False))
        if found is None:
            return None, plan
        return Reservation(j.job.job_id, found[0], dict(zip(found[1], counts))), plan

    def _backfill_plan(self) -> BackfillPlan:
        """The idle GPUs per node and every running whole-GPU (or guaranteed) job's end per node, now."""
        free: dict[int, int] = {}
        for i in self.free_gpus:
            free[self.gpus[i].node] = free.get(self.gpus[i].node, 0) + 1
        whole = self.cfg.policy in WHOLE_GPU
        scav = self.cfg.policy == "scavenger"
        ends: list[tuple[float, int, int]] = []
        for x in self._running_on_gpus(opportunistic=whole):
            if x.state != "RUNNING" or not (whole or x.klass == "guaranteed"):
                continue
            per_node: dict[int, int] = {}
            for i in x.gpus:
                per_node[self.gpus[i].node] = per_node.get(self.gpus[i].node, 0) + 1
            if scav and not self._is_high(x):
                t = self.now  # preemptible: the high partition counts its GPUs as its own
            elif x.rate > 0:
                t = max(self.now, x.t_last) + max(x.work_left, 0.0) / x.rate
            else:
                continue  # paused in place: no end in sight
            ends.extend((t, n, k) for n, k in per_node.items())
        return BackfillPlan(free, ends, self.now + self.cfg.bf_window_s, self.now)

    def _running_on_gpus(self, opportunistic: bool) -> Iterable[SimJob]:
        """The jobs on the GPUs (guaranteed ones, and opportunistic ones if asked), each once: the running
        jobs, found without stepping over a long queue's pending ones in ``active``."""
        seen: dict[str, SimJob] = {}
        jobs = self.jobs
        for g in self.gpus:
            for jid in g.guar:
                if jid not in seen:
                    seen[jid] = jobs[jid]
            if opportunistic:
                for jid in g.opp:
                    if jid not in seen:
                        seen[jid] = jobs[jid]
        return seen.values()
