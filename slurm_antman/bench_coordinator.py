"""``antman bench coordinator``: the coordinator's decision cycle, measured on this machine.

- ``cycle_ms_10k`` / ``cycle_ms_10k_p95``: median and 95th percentile wall time of one
  ``policy.decide()`` on a synthetic snapshot of 10,000 GPUs (1,250 nodes x 8) and 5,000 jobs
  (target: at most 50 ms). Each run starts from an empty coordinator state, the worst case: every
  decision the snapshot calls for is emitted (a steady-state cycle suppresses the repeats and is
  cheaper; ``cycle_ms_10k_steady`` is that one).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections import Counter
from typing import Optional

from .policy import CoordinatorState, decide
from .policy.builders import PARAMS, synthetic_cluster

TARGET_MS = 50.0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def cycle_benchmark(runs: int = 21, nodes: int = 1250, gpus_per_node: int = 8, jobs: int = 5000,
                    seed: int = 0) -> dict:
    snap = synthetic_cluster(nodes, gpus_per_node, jobs, seed)
    empty = CoordinatorState.empty()
    decisions, state = decide(snap, empty, PARAMS)  # warm-up: imports, caches
    cold: list[float] = []
    steady: list[float] = []
    for _ in range(runs):
        gc.collect()  # each sample pays for its own garbage only
        t0 = time.perf_counter()
        decide(snap, empty, PARAMS)
        t1 = time.perf_counter()
        decide(snap, state, PARAMS)
        t2 = time.perf_counter()
        cold.append((t1 - t0) * 1000.0)
        steady.append((t2 - t1) * 1000.0)
    return {
        "cycle_ms_10k": round(statistics.median(cold), 2),
        "cycle_ms_10k_p95": round(_percentile(cold, 0.95), 2),
        "cycle_ms_10k_steady": round(statistics.median(steady), 2),
        "cycle_target_ms": TARGET_MS,
        "cycle_runs": runs,
        "cycle_gpus": nodes * gpus_per_node,
        "cycle_jobs": jobs,
        "cycle_decisions": dict(sorted(Counter(d.kind for d in decisions).items())),
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="antman bench coordinator", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    ap.add_argument("--runs", type=int, default=21, help="timed decision cycles (default 21)")
    a = ap.parse_args(argv)
    if a.runs < 1:
        ap.error(f"--runs must be at least 1, got {a.runs}")
    res = cycle_benchmark(runs=a.runs)
    if a.json:
        print(json.dumps(res))
        return 0
    for k, v in res.items():
        note = f"   (target <= {TARGET_MS:g} ms)" if k in ("cycle_ms_10k", "cycle_ms_10k_p95") else ""
        print(f"{k:22} {v}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
