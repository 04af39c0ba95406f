"""What every run of a trace window takes, whether the simulator runs it (``simulator.SimConfig``)
or the devcluster replays it (``replay.ReplayConfig``): the cluster, how the trace is scaled, and
the few policy settings both honour. One source, so that ``antman bench trace --with-simulator``
simulates exactly the run it replayed."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from .workloads import MIN_GPU_MEMORY_BYTES, GiB


@dataclass(frozen=True)
class TraceRunConfig:
    policy: str = "antman"
    nodes: int = 4
    gpus_per_node: int = 8
    gpu_mem_bytes: int = 32 * GiB
    speedup: float = 1.0          # every trace time divided by this
    quota_scale: float = 1.0
    slots_per_gpu: int = 3        # antman.yaml's opportunistic.slots_per_gpu; shared's shards per GPU
    # Times below are in the run's seconds: trace seconds divided by speedup.
    grace_s: float = 30.0
    # shared: a job that fails with CUDA out of memory is FAILED in Slurm, and only its user brings it
    # back (``oom_resubmit_delay``): its first resubmission this long after the failure, each further
    # failure of the same job doubling the wait, up to ``oom_retry_max_s``, as often as it takes.
    oom_retry_s: float = 60.0
    oom_retry_max_s: float = 3600.0
    seed: int = 0                 # workload profile assignment

    # What a bad value raises: each kind of run reports errors as its command does.
    _error: ClassVar[type[Exception]] = ValueError

    def _check_gpu_memory(self) -> None:
        if self.gpu_mem_bytes < MIN_GPU_MEMORY_BYTES:
            # A profile that cannot fit a GPU alone would fail with OOM forever.
            raise self._error(f"--gpu-mem-gib must be >= {MIN_GPU_MEMORY_BYTES / GiB:g}: every profile of the "
                              "workload model must fit a GPU alone")

    def _check_oom_retry(self) -> None:
        if not (0 <= self.oom_retry_s < float("inf")):
            raise self._error(f"--oom-retry-s must be a number of seconds >= 0, got {self.oom_retry_s}")
        if not (0 <= self.oom_retry_max_s < float("inf")):
            raise self._error(f"--oom-retry-max-s must be a number of seconds >= 0, got {self.oom_retry_max_s}")

    def common(self) -> dict[str, Any]:
        """These shared fields by name, to make the other kind of run of the same window."""
        return {f.name: getattr(self, f.name) for f in fields(TraceRunConfig)}


def oom_resubmit_delay(retry_s: float, retry_max_s: float, failures: int) -> float:
    """Seconds from a job's ``failures``-th CUDA out-of-memory failure (1 for the first) to its user's
    resubmission: ``retry_s``, doubled for each earlier failure of the same job, at most ``retry_max_s``
    (never less than ``retry_s``: ``retry_max_s`` equal to it, or under it, waits ``retry_s`` every time).

    Slurm does not bring such a job back: it exits non-zero and ends FAILED, and a batch job is requeued
    only by an administrator, after a node failure or on preemption (slurm.conf ``JobRequeue``), or for
    an exit code the site lists in ``RequeueExit`` (none by default; a CUDA out-of-memory error exits
    1, like most failures, so a site cannot single it out there). Its user resubmits it: by default a
    script that does a minute after the first failure, doubles the wait at each further one and never
    waits more than an hour (truncated exponential back-off), with no limit on the attempts, so that
    every job of the trace finishes and the policies' JCTs cover the same jobs. That is sooner than a
    person who reads Slurm's failure mail (``--mail-type=FAIL``). Retrying every minute instead
    (``retry_max_s`` equal to ``retry_s``) made a job that could not fit beside its GPU's neighbours for
    days fail every minute for days: on the whole Philly trace at 3 slots per GPU the replay did not
    finish in 28 minutes (docs/evaluation.md, "The baselines", compares the two)."""
    # (the doubling stops counting where it passes any cap: 2.0 ** 1024 overflows a float, and a job
    # retried every minute fails more often than that within a day)
    return min(max(retry_max_s, retry_s), retry_s * 2.0 ** min(max(0, failures - 1), 64))
