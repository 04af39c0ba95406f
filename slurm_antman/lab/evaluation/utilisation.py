"""How busy each trace job keeps its GPUs: drawn from what production clusters measured.

A benchmark keeps a GPU near 100 % busy; a training job in a production cluster does not (data
loading, communication between servers, evaluation, checkpoints, a user's debugging session). The
workload model needs the production figure, because interference follows from each job's idle time
(``workloads`` module doc). Two modes:

- ``saturated``: every job as busy as its benchmark (duty 1): the model before production figures,
  kept as the pessimistic case.
- ``production``: each job's mean utilisation is drawn from the published distribution of the
  cluster its trace comes from (``PHILLY`` for the Philly trace, by job size; ``PAI`` for Alibaba's
  openb pods), deterministically from the job id, so every policy and every run sees the same job.

The distributions are quantile tables: (cumulative probability, utilisation) points, linear in
between. Their sources are below and in docs/workload_model.md. Both are distributions of samples
(GPU-minutes for Philly, task lifetimes for PAI), used here as the distribution of per-job means:
the formula is bilinear in the two jobs' duties, so with independent draws the mean interference
depends only on the mean utilisation, which this keeps.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass
from typing import Mapping

MODES = ("production", "saturated")

# No job is drawn completely idle: a job that holds a GPU launches some kernels, and a duty of 0
# would make it immune to any neighbour.
MIN_UTILISATION = 0.01


@dataclass(frozen=True)
class Quantiles:
    """A distribution as (cumulative probability, value) points from (0, ...) to (1, ...)."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        ps = [p for p, _ in self.points]
        vs = [v for _, v in self.points]
        if ps[0] != 0.0 or ps[-1] != 1.0 or ps != sorted(ps) or vs != sorted(vs):
            raise ValueError(f"quantile points must run from p=0 to p=1, both columns non-decreasing: {self.points}")

    def at(self, q: float) -> float:
        """The value at cumulative probability ``q`` (linear between points)."""
        ps = [p for p, _ in self.points]
        k = min(max(bisect.bisect_right(ps, q), 1), len(ps) - 1)
        (p0, v0), (p1, v1) = self.points[k - 1], self.points[k]
        return v0 if p1 == p0 else v0 + (v1 - v0) * (q - p0) / (p1 - p0)

    def mean(self, steps: int = 10_000) -> float:
        return sum(self.at((i + 0.5) / steps) for i in range(steps)) / steps


# Philly (Jeon et al., ATC'19): nvidia-smi utilisation of every GPU of a job, one sample a minute,
# for jobs that ran to completion ("Pass"), by job size. Read from the authors' released analysis,
# msr-fiddle/philly-traces "analysis/Philly Trace Analysis.ipynb" @73877391f3127393d4dc130c9c8ca9a86ca89822,
# section "GPU Utilization (Figures 5, 6)": the CDF plots of the released trace, digitised (about
# +-1.5 points): the share of samples at 0 %, then the median, p75 and p90. Not the paper's printed
# table, which was not available to check against.
_PHILLY_PASS = {
    # GPUs: (share at 0, median, p75, p90); the table's mean in the comment (the notebook's ~0.47-0.50)
    1: (0.29, 0.55, 0.89, 0.98),    # 0.48
    4: (0.28, 0.53, 0.89, 0.96),    # 0.47
    8: (0.20, 0.52, 0.90, 0.98),    # 0.50
    16: (0.27, 0.47, 0.87, 0.93),   # 0.45
}


def _from_summary(at_zero: float, median: float, p75: float, p90: float) -> Quantiles:
    return Quantiles(((0.0, 0.0), (at_zero, 0.0), (0.5, median), (0.75, p75), (0.9, p90), (1.0, 1.0)))


PHILLY: Mapping[int, Quantiles] = {g: _from_summary(*v) for g, v in _PHILLY_PASS.items()}

# Alibaba PAI (Weng et al., NSDI'22, trace cluster-trace-gpu-v2020): gpu_wrk_util, the mean over an
# instance's life of the GPU it used (nvidia-smi's Utilization.GPU; the maintainer's definition in
# alibaba/clusterdata issue #125, https://github.com/alibaba/clusterdata/issues/125), summed over a
# task's instances. From the authors' notebook alibaba/clusterdata cluster-trace-gpu-v2020
# "analysis/analysis.ipynb" @1d729891, its Figure 6 "GPU usage" CDF, digitised: 66 % of tasks at or
# under 3 % of a GPU, p75 18 %, p90 58 %, p95 over one GPU (capped at one here: a share of one GPU).
# Training and inference together, as openb's pods are.
PAI = Quantiles(((0.0, 0.0), (0.66, 0.03), (0.75, 0.18), (0.9, 0.58), (0.95, 1.0), (1.0, 1.0)))

SOURCES: Mapping[str, str] = {
    "philly": "Jeon et al. ATC'19, released Philly trace analysis (msr-fiddle/philly-traces "
              "analysis/Philly Trace Analysis.ipynb @73877391, Figures 5-6), digitised CDFs of passed jobs by size",
    "pai": "Weng et al. NSDI'22, alibaba/clusterdata cluster-trace-gpu-v2020 analysis/analysis.ipynb @1d729891 "
           "Figure 6 (task GPU usage), digitised CDF",
}


def philly_table(gpus: int) -> Quantiles:
    """The size class a job of ``gpus`` GPUs falls in: the smallest published size >= it."""
    sizes = sorted(PHILLY)
    k = bisect.bisect_left(sizes, gpus)
    return PHILLY[sizes[min(k, len(sizes) - 1)]]


def _unit(job_id: str, seed: int) -> float:
    # A different salt from the profile assignment's, so utilisation and model are independent.
    h = hashlib.blake2b(f"util:{seed}:{job_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0 ** 64


def draw(job_id: str, gpus: int, source: str, seed: int = 0) -> float:
    """The job's mean GPU utilisation, 0..1, from ``source`` ("philly" or "pai")."""
    if source not in SOURCES:
        raise ValueError(f"utilisation source {source!r} is not known; known: {', '.join(SOURCES)}")
    table = philly_table(gpus) if source == "philly" else PAI
    return max(MIN_UTILISATION, table.at(_unit(job_id, seed)))


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"--utilisation {mode!r} is not allowed; allowed: {', '.join(MODES)}")
    return mode
