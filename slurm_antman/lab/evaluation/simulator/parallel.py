"""Several simulations of one trace at once (``antman bench simulate --jobs N``): the policies of one
``--policy all`` and the shifted cycles of ``--perturb``, each in a process of its own.

A run depends on nothing but its jobs and its settings: no clock, no random state outside the seeded
workload draws, no iteration over a set of strings whose order could change with the process
(tests/test_simulator_parallel.py checks that ``--jobs 2`` gives the runs of ``--jobs 1``). So the runs
are handed out to a process pool and their results put back in the order they were asked for.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Callable, Optional, Sequence

from ..traces import TraceJob
from .config import SimConfig
from .engine import simulate
from .state import SimResult

_JOBS: Sequence[TraceJob] = ()  # a worker's copy of the trace, sent once per worker, not once per run


def _init(jobs: Sequence[TraceJob]) -> None:
    global _JOBS
    _JOBS = jobs


def _one(cfg: SimConfig, jobs: Optional[Sequence[TraceJob]] = None) -> SimResult:
    t = time.perf_counter()
    r = simulate(_JOBS if jobs is None else jobs, cfg)
    r.metrics["wall_s"] = round(time.perf_counter() - t, 3)
    return r


def default_workers() -> int:
    """One process per core but one (left to the rest of the machine), at least one."""
    return max(1, (os.cpu_count() or 1) - 1)


def simulate_many(jobs: Sequence[TraceJob], cfgs: Sequence[SimConfig], workers: int = 1,
                  done: Optional[Callable[[int, SimResult], None]] = None) -> list[SimResult]:
    """Each config's run of ``jobs``, in the order of ``cfgs``, with its wall time in ``metrics["wall_s"]``;
    in up to ``workers`` processes when that is more than one (and there is more than one run).
    ``done(k, result)`` is called for each run as it ends, in this process: the caller's writing of a
    run's results then goes on beside the runs still going (the longest ends last)."""
    if workers < 1:
        raise ValueError(f"--jobs must be at least 1, got {workers}")
    if workers == 1 or len(cfgs) <= 1:
        out = []
        for k, c in enumerate(cfgs):
            out.append(_one(c, jobs))
            if done is not None:
                done(k, out[-1])
        return out
    # Longest first finishes sooner: how long a run takes is not known before it runs, but antman's
    # runs, which model every GPU's node loop and the coordinator's cycles, take several times a
    # baseline's (docs/benchmarks.md, "Trace replay": 231 s against 13-40 s on the whole Philly trace),
    # so they go to the pool first; the pool hands the next run to whichever process is free.
    order = sorted(range(len(cfgs)), key=lambda k: (cfgs[k].policy != "antman", k))
    with ProcessPoolExecutor(max_workers=min(workers, len(cfgs)), initializer=_init, initargs=(list(jobs),)) as pool:
        futures = {k: pool.submit(_one, cfgs[k]) for k in order}
        if done is not None:
            index = {f: k for k, f in futures.items()}
            for f in as_completed(futures.values()):
                done(index[f], f.result())
        return [futures[k].result() for k in range(len(cfgs))]
