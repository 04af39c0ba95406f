"""The node as the sidecar shows it: the control socket's ``node_state`` (``antman`` on the node, the
Prolog), the ``node_report`` sent to the coordinator and what its Prometheus endpoint shows."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import slurm_antman
from slurm_antman import protocol as p
from slurm_antman.policy.node.core import PolicyState, PreemptRequest

from .records import RegisteredJob, agent_memory
from .telemetry import GpuSample, ProcessSample, UtilizationWindow

if TYPE_CHECKING:
    from slurm_antman.metrics import SidecarView


@dataclass(frozen=True)
class GpuSeen:
    """One GPU as both views show it."""

    sample: GpuSample
    util_avg: float  # the utilisation window's average; each view bounds it as its message requires
    jobs: list[str]
    util_measured: bool


@dataclass(frozen=True)
class JobSeen:
    """One job as both views show it."""

    job: RegisteredJob
    mem_used_bytes: int  # its agents' memory, as the larger of report and driver shows it
    iteration_ms: Optional[float]  # the slowest agent's last report




class ReportViews:
    """Mixed into ``daemon.Sidecar``: read-only views of its state."""

    jobs: dict[str, RegisteredJob]
    gpu_samples: list[GpuSample]
    proc_samples: list[ProcessSample]
    util: UtilizationWindow
    policy_state: PolicyState
    progress: dict[str, float]
    noncompliant: dict[str, PreemptRequest]
    unhealthy: str

    def _seen(self) -> tuple[list[GpuSeen], list[JobSeen]]:
        proc_mem = {s.pid: s.memory_bytes for s in self.proc_samples if s.memory_bytes is not None}
        now = time.time()
        gpus = []
        for s in self.gpu_samples:
            on = [j for j in self.jobs.values() if s.index in j.gpus]
            gpus.append(GpuSeen(s, self.util.average(s.index), [j.job_id for j in on], self._util_measured(on, now)))
        jobs = []
        for j in self.jobs.values():
            jobs.append(JobSeen(
                j, p.clamp_number(sum(agent_memory(a, proc_mem) for a in j.agents.values())),
                max((a.report.iteration_ms for a in j.agents.values() if a.report is not None), default=None)))
        return gpus, jobs

    def _node_state(self) -> p.NodeStateReply:
        seen_gpus, seen_jobs = self._seen()
        gpus = [p.GpuState(index=g.sample.index, memory_used_bytes=g.sample.memory_used_bytes,
                           memory_total_bytes=g.sample.memory_total_bytes, utilization=g.sample.utilization,
                           utilization_avg=min(1.0, g.util_avg), jobs=g.jobs, util_measured=g.util_measured)
                for g in seen_gpus]
        jobs = []
        for seen in seen_jobs:
            j = seen.job
            track = self.policy_state.guaranteed.get(j.job_id)
            jobs.append(p.JobState(
                job_id=j.job_id, job_class=j.job_class, uid=j.uid, gpus=list(j.gpus),
                mem_limit_bytes=j.limits.mem_limit_bytes, mem_used_bytes=seen.mem_used_bytes,
                compute_share=j.limits.compute_share, iteration_ms=seen.iteration_ms,
                baseline_ms=track.baseline_ms if track else None,
                last_report_unix=max((a.report_unix for a in j.agents.values()
                                      if a.report is not None and a.report_unix), default=None),
                agents=len(j.agents), limits_seq=j.seq,
                acked_seq=min((a.acked_seq for a in j.agents.values()), default=0), paused=j.paused))
        pre = [p.PreemptState(job_id=j.job_id, reason=j.preempt.reason, requested_unix=j.preempt.requested_unix,
                              deadline_unix=j.preempt.deadline_unix)
               for j in self.jobs.values() if j.preempt is not None]
        return p.NodeStateReply(node=self.opt.node, telemetry=self.telemetry.kind,
                                sidecar_version=slurm_antman.__version__, gpus=gpus, jobs=jobs, preemptions=pre,
                                unhealthy=self.unhealthy[:1024])

    def _node_report(self) -> p.NodeReport:
        seen_gpus, seen_jobs = self._seen()
        gpus = [p.ReportGpu(index=g.sample.index, mem_total_bytes=g.sample.memory_total_bytes,
                            mem_used_bytes=g.sample.memory_used_bytes, util=min(1.0, max(0.0, g.util_avg)),
                            jobs=g.jobs, util_measured=g.util_measured)
                for g in seen_gpus]
        jobs = []
        for seen in seen_jobs:
            j = seen.job
            jobs.append(p.ReportJob(
                job_id=j.job_id, job_class=j.job_class, gpus=list(j.gpus), mem_limit_bytes=j.limits.mem_limit_bytes,
                mem_used_bytes=seen.mem_used_bytes if j.agents else None,
                compute_share=j.limits.compute_share, iteration_ms=seen.iteration_ms,
                last_checkpoint_unix=None,  # agents do not report checkpoints (yet): the job's start counts
                progress=self.progress.get(j.job_id), crawling_since_unix=self.policy_state.crawling.get(j.job_id),
                placement=j.placement, placement_note=j.note[:1024], paused=j.paused,
                pause_reason=(self.policy_state.paused[j.job_id].reason[:1024]
                              if j.paused and j.job_id in self.policy_state.paused else "")))
        pre = [p.ReportPreemptRequest(job_id=r.job_id, gpu=r.gpu, reason=r.reason, since_unix=r.requested_unix)
               for r in self.policy_state.preempted.values() if r.job_id in self.jobs and r.job_id not in self.noncompliant]
        pre += [p.ReportPreemptRequest(job_id=r.job_id, gpu=r.gpu, reason=r.reason[:4096], since_unix=r.requested_unix,
                                       noncompliant=True)
                for r in self.noncompliant.values() if r.job_id in self.jobs]
        return p.NodeReport(node=self.opt.node, telemetry=self.telemetry.kind, gpus=gpus, jobs=jobs,
                            preempt_requests=pre, unhealthy=self.unhealthy[:1024])

    def metrics_view(self) -> SidecarView:
        """What the Prometheus endpoint shows of this sidecar (slurm_antman.metrics); from the loop thread."""
        # Imported here: metrics needs prometheus_client, which a GPU node without metrics may not have.
        from slurm_antman.metrics import GpuPoint, JobPoint, SidecarView

        proc_mem = {s.pid: s.memory_bytes for s in self.proc_samples if s.memory_bytes is not None}
        gpus = tuple(GpuPoint(s.index, s.memory_used_bytes, s.memory_total_bytes, s.utilization)
                     for s in self.gpu_samples)
        jobs = []
        for j in self.jobs.values():
            reports = [a.report for a in j.agents.values() if a.report is not None]
            # Older agents lack the optional fields: absent, not zero, so a dashboard does not show a
            # throttle that nobody measured.
            delays = [r.throttle_delay_ms for r in reports if getattr(r, "throttle_delay_ms", None) is not None]
            spills = [r.spilled_bytes for r in reports if getattr(r, "spilled_bytes", None) is not None]
            jobs.append(JobPoint(
                job_id=j.job_id, account=getattr(j, "account", None) or "", job_class=j.job_class,
                mem_limit_bytes=j.limits.mem_limit_bytes,
                mem_used_bytes=sum(agent_memory(a, proc_mem) for a in j.agents.values()),
                compute_share=j.limits.compute_share,
                iteration_ms=max((r.iteration_ms for r in reports), default=None),
                throttle_delay_ms=max(delays) if delays else None,
                spilled_bytes=sum(spills) if spills else None))
        return SidecarView(self.opt.node, gpus, tuple(jobs), self.placement_waits, self.noncompliant_total,
                           self.state_write_errors, self.pauses_total, self.pause_seconds_total,
                           self.pause_bytes_moved_total, self.width_shrinks_total, self.width_grows_total,
                           self.width_unreturned_total)
