"""Whether an opportunistic job keeps to its limits without its goodwill: the agent inside
the job is what applies limits, and a job may disable it, crash it or lie. Pure: the sidecar measures,
this decides.

An opportunistic job that shares a GPU with a guaranteed job is *non-compliant* when, for longer than
``grace_s``, any of these holds:

* its processes are on the GPU (NVML, mapped to the job through Slurm's cgroups) and no agent of it
  has registered: it runs unmanaged;
* an agent has not acknowledged the limits the sidecar sent it: it does not apply them;
* its processes hold more GPU memory than its limit, beyond a tolerance: it does not keep to it.

A job alone on its GPU, or with only opportunistic neighbours, harms no guaranteed job and may run
without its agent (``ANTMAN_AGENT_DISABLE=1``). A paused job is compliant by definition.
The sidecar asks the coordinator to requeue a non-compliant job at once; the grace time covers a
job's start (importing torch, building the model) and a limit change in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

MiB = 1 << 20


@dataclass(frozen=True)
class ComplianceParams:
    grace_s: float = 120.0
    mem_tolerance: float = 0.10        # over the limit by more than this fraction ...
    mem_slack_bytes: int = 256 * MiB   # ... and this much (allocator rounding, CUDA context)


@dataclass(frozen=True)
class JobCompliance:
    job_id: str
    shares_with_guaranteed: bool
    agents: int
    gpu_processes: Optional[int]       # its processes on its GPUs; None: telemetry cannot see processes
    unacked_since: Optional[float]     # since when an agent has not acknowledged its current limits
    mem_used_bytes: int                # what its processes hold on the GPU (NVML) or its agents report
    mem_limit_bytes: Optional[int]
    paused: bool = False


def _conditions(j: JobCompliance, p: ComplianceParams) -> dict[str, str]:
    out: dict[str, str] = {}
    if j.agents == 0 and j.gpu_processes:
        out["no_agent"] = (f"{j.gpu_processes} process(es) of the job on a GPU shared with a guaranteed job and no "
                           "agent registered (ANTMAN_AGENT_DISABLE is allowed only alone on a GPU)")
    if j.unacked_since is not None:
        out["no_ack"] = "its agent does not acknowledge the limits it was sent"
    if j.mem_limit_bytes is not None and j.mem_used_bytes > j.mem_limit_bytes * (1 + p.mem_tolerance) + p.mem_slack_bytes:
        out["over_memory"] = (f"holds {j.mem_used_bytes // MiB} MiB of GPU memory, over its limit of "
                              f"{j.mem_limit_bytes // MiB} MiB")
    return out


def step(jobs: list[JobCompliance], since: Mapping[tuple[str, str], float], p: ComplianceParams,
         now: float) -> tuple[dict[str, str], dict[tuple[str, str], float]]:
    """(job -> why it is non-compliant, the new state: (job, condition) -> since when it holds)."""
    state: dict[tuple[str, str], float] = {}
    bad: dict[str, str] = {}
    for j in jobs:
        if not j.shares_with_guaranteed or j.paused:
            continue
        for kind, why in sorted(_conditions(j, p).items()):
            start = since.get((j.job_id, kind))
            if start is None:
                # From when this sidecar first saw it (a restarted sidecar gives reconnecting agents the
                # whole grace time), or from when the unacknowledged limits were sent.
                start = min(now, j.unacked_since) if kind == "no_ack" and j.unacked_since is not None else now
            state[(j.job_id, kind)] = start
            if now - start >= p.grace_s and j.job_id not in bad:
                bad[j.job_id] = f"non-compliant for {now - start:.0f} s: {why}"
    return bad, state
