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
    oom_retry_s: float = 60.0     # shared: from a job's OOM failure to its retry
    seed: int = 0                 # workload profile assignment

    # What a bad value raises: each kind of run reports errors as its command does.
    _error: ClassVar[type[Exception]] = ValueError

    def _check_gpu_memory(self) -> None:
        if self.gpu_mem_bytes < MIN_GPU_MEMORY_BYTES:
            # A profile that cannot fit a GPU alone would fail with OOM forever.
            raise self._error(f"--gpu-mem-gib must be >= {MIN_GPU_MEMORY_BYTES / GiB:g}: every profile of the "
                              "workload model must fit a GPU alone")

    def common(self) -> dict[str, Any]:
        """These shared fields by name, to make the other kind of run of the same window."""
        return {f.name: getattr(self, f.name) for f in fields(TraceRunConfig)}
