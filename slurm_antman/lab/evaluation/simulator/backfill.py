"""EASY backfill's reservation, planned from running jobs' ends kept in order as they change.

A pass over a long queue asks for a reservation at every whole-GPU job that cannot start as long as
none is held (``scheduler._schedule_pass``): when the first such job's reservation lies beyond
bf_window, the next one asks again, and so on down the queue. Each answer walks the running jobs'
ends in time order until enough GPUs are free. Planning it from scratch (gathering and sorting every
running job's end at every ask) cost most of a whole-trace run, so:

- ``RunningEnds`` keeps the running jobs' ends in order as they change. A job's end is
  ``max(now, t_last) + work_left / rate`` (``_run_estimate``'s view of a running job: it progresses
  from ``t_last`` on), which only its start, a change of its rate (``interference._refresh``, which
  also advances it) and its release change. Once it has started progressing (``t_last <= now``) its
  end is ``now + d`` with ``d = work_left / rate`` fixed, so the order by ``d`` is the order in time
  at every instant; the few still starting up (``t_last > now``) are merged in apart.
- ``BackfillPlan`` is one instant's view: the idle GPUs and the walk over those ends, taken once per
  shape of job (its GPUs per node) until a start changes the running jobs.

The answers are those of planning from scratch for every job, to the bit: the same floating-point
times, every end at one instant counted before looking again (tests/test_simulator_speed.py checks
it on random cases against the planning this replaced).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from typing import Callable, Iterator, Optional

from .config import WHOLE_GPU
from .state import Reservation, SimJob


def split(want: int, nodes: int) -> list[int]:
    """``want`` GPUs over ``nodes`` nodes as evenly as they go, larger parts first (12 over 2: [6, 6];
    20 over 3: [7, 7, 6]): how select/cons_tres spreads ``--gpus=g -N n``."""
    base, extra = divmod(want, nodes)
    return [base + 1] * extra + [base] * (nodes - extra)


# (GPUs available per node, GPUs per node the job needs) -> the nodes chosen, or None
PickNodes = Callable[[dict[int, int], list[int]], Optional[list[int]]]
PerNode = tuple[tuple[int, int], ...]  # (node, GPUs the job holds there)


class RunningEnds:
    """The ends of the running jobs a reservation waits for, by ``d`` (module doc)."""

    def __init__(self) -> None:
        self.order: list[tuple[float, str]] = []  # (d, job) sorted
        self.filed: dict[str, tuple[float, float, PerNode]] = {}  # job -> (d, t_last, its GPUs per node)
        self.at_now: dict[str, PerNode] = {}  # scavenger's preemptible jobs: their GPUs count as free now
        self.starting: set[str] = set()  # filed with t_last ahead of the instant they were filed at

    def drop(self, jid: str) -> None:
        f = self.filed.pop(jid, None)
        if f is not None:
            i = bisect_left(self.order, (f[0], jid))
            del self.order[i]
            self.starting.discard(jid)
        self.at_now.pop(jid, None)

    def file(self, jid: str, d: float, t_last: float, per_node: PerNode, now: float) -> None:
        self.drop(jid)
        self.filed[jid] = (d, t_last, per_node)
        insort(self.order, (d, jid))
        if t_last > now:
            self.starting.add(jid)

    def walk(self, now: float) -> Iterator[tuple[float, PerNode]]:
        """Every end at ``now`` or later, as (time, GPUs per node), in time order."""
        for per_node in self.at_now.values():
            yield now, per_node
        ahead = [jid for jid in self.starting if self.filed[jid][1] > now]
        self.starting.difference_update([jid for jid in self.starting if self.filed[jid][1] <= now])
        filed = self.filed
        main = ((now + d, filed[jid][2]) for d, jid in self.order if jid not in ahead) if ahead else \
            ((now + d, filed[jid][2]) for d, jid in self.order)
        if not ahead:
            yield from main
            return
        late = sorted(((filed[jid][1] + filed[jid][0], jid) for jid in ahead))
        yield from heapq.merge(main, ((t, filed[jid][2]) for t, jid in late), key=lambda e: e[0])


class BackfillPlan:
    """The idle GPUs per node and the running jobs' ends at one instant; the earliest start found per
    job shape."""

    def __init__(self, free: dict[int, int], ends: RunningEnds, horizon: float, now: float):
        self.free = free
        self.ends = ends
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
        ends = self.ends.walk(self.now)
        nxt = next(ends, None)
        t, out = self.now, None
        while True:
            nodes = pick(free, counts)
            if nodes is not None:
                out = (t, nodes)
                break
            if nxt is None:
                break
            t = nxt[0]
            if t > self.horizon:
                break
            while nxt is not None and nxt[0] == t:
                for n, k in nxt[1]:
                    free[n] = free.get(n, 0) + k
                nxt = next(ends, None)
        self.found[key] = out
        return out


class EasyBackfill:
    """The reservation's half of ``SlurmScheduler``: it works on the simulator's state (``engine``)."""

    def _reserve(self, j: SimJob, plan: Optional[BackfillPlan]) -> tuple[Optional[Reservation], BackfillPlan]:
        """The earliest time, within bf_window, at which the running jobs' ends leave room for ``j``,
        and the GPUs it would take then (None beyond the window); and the plan it was read from, valid
        until the next start."""
        if plan is None:
            plan = BackfillPlan({n: len(lst) for n, lst in self._free_by_node().items()}, self.ends,
                                self.now + self.cfg.bf_window_s, self.now)
        counts = split(j.job.gpus, self._nodes_for(j.job.gpus))
        found = plan.earliest(counts, lambda free, c: self._pick_nodes(free, c, one_switch=False))
        if found is None:
            return None, plan
        return Reservation(j.job.job_id, found[0], dict(zip(found[1], counts))), plan

    def _end_changed(self, j: SimJob) -> None:
        """A running job started, or its rate changed (``interference._refresh``, which advanced it):
        its end, if a reservation waits for it (every job under whole GPUs, guaranteed ones otherwise;
        a paused one has none in sight)."""
        jid = j.job.job_id
        whole = self.cfg.policy in WHOLE_GPU
        if j.state != "RUNNING" or not (whole or j.klass == "guaranteed"):
            self.ends.drop(jid)
            return
        per_node: dict[int, int] = {}
        for i in j.gpus:
            per_node[self.gpus[i].node] = per_node.get(self.gpus[i].node, 0) + 1
        held = tuple(per_node.items())
        if self.cfg.policy == "scavenger" and not self._is_high(j):
            self.ends.drop(jid)
            self.ends.at_now[jid] = held  # preemptible: the high partition counts its GPUs as its own
        elif j.rate > 0:
            self.ends.file(jid, max(j.work_left, 0.0) / j.rate, j.t_last, held, self.now)
        else:
            self.ends.drop(jid)
