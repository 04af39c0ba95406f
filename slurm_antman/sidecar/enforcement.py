"""The enforcement loop: on every tick and after every report, telemetry sampled, the local policy
(``slurm_antman.policy.node.core``) run on a snapshot of the jobs, and what it decides sent: limits,
pauses and resumes, preemptions; where the node enforces, driver memory caps and the compliance
rule (``slurm_antman.policy.node.compliance``); and the node's health, which gates opportunistic jobs."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Optional

from slurm_antman import device_failure
from slurm_antman import protocol as p
from slurm_antman.policy.node import compliance
from slurm_antman.policy.node.core import (
    UNLIMITED, GpuInfo, JobInfo, PolicyState, PreemptRequest, NodeSnapshot, WidthChange, decide,
)
from slurm_antman.policy.node.placement import util_measured

from . import driver_caps, health, peers
from .agent_channel import AGENT_TIMEOUT_HEARTBEATS, PAUSE_TIMES_KEPT
from .records import AgentConnection, RegisteredJob, agent_memory
from .telemetry import GpuSample, ProcessSample, ReportedLoad, Telemetry, UtilizationWindow

log = logging.getLogger("antman.sidecar")

HEALTH_CHECK_S = 2.0  # statvfs of the state directories at most this often


class Enforcement:
    """Mixed into ``daemon.Sidecar``, which makes this state."""

    telemetry: Telemetry
    jobs: dict[str, RegisteredJob]
    policy_state: PolicyState
    progress: dict[str, float]
    util: UtilizationWindow
    gpu_samples: list[GpuSample]
    proc_samples: list[ProcessSample]
    gpu_procs_by_job: dict[str, list[int]]
    gpu_pids_by_job: dict[str, list[int]]
    caps: Optional[driver_caps.MemoryCaps]
    cap_errors: int
    compliance_since: dict[tuple[str, str], float]
    noncompliant: dict[str, PreemptRequest]
    noncompliant_total: int
    unhealthy: str
    pauses_total: int
    pause_seconds_total: float
    width_shrinks_total: int
    width_grows_total: int
    width_unreturned_total: int
    width_return_s: list[float]
    _health_checked: float
    _report_now: bool

    def _tick(self, now: float, mono: float) -> None:
        self._heartbeat_agents(mono)
        self._sample(now)
        self._check_health(mono)
        self._run_policy(now)
        self._publish_metrics()

    def _sample(self, now: float) -> None:
        fresh_after = time.monotonic() - AGENT_TIMEOUT_HEARTBEATS * self.opt.heartbeat_s
        mem: dict[int, int] = {}
        busy: dict[int, float] = {}
        for job in self.jobs.values():
            for a in job.agents.values():
                if a.gpu is None or a.report is None or a.last_seen < fresh_after:
                    continue
                mem[a.gpu] = mem.get(a.gpu, 0) + a.report.mem_reserved_bytes
                if a.report.iteration_ms > 0:
                    busy[a.gpu] = busy.get(a.gpu, 0.0) + min(1.0, a.report.busy_ms / a.report.iteration_ms)
        reported = {g: ReportedLoad(mem.get(g, 0), busy.get(g, 0.0)) for g in set(mem) | set(busy)}
        try:
            self.gpu_samples, self.proc_samples = self.telemetry.sample(reported)
        except Exception as e:  # a driver hiccup must not stop the node's sidecar
            self._rlog.warning("telemetry", "telemetry sample failed: %s", e)
            return
        procs: dict[str, list[int]] = {}
        pids: dict[str, list[int]] = {}
        for s in self.proc_samples:
            for job_id in peers.slurm_jobs_of(s.pid) or ():
                procs.setdefault(job_id, []).append(s.memory_bytes or 0)
                pids.setdefault(job_id, []).append(s.pid)
        self.gpu_procs_by_job = procs
        self.gpu_pids_by_job = pids
        for s in self.gpu_samples:
            self.util.add(now, s.index, s.utilization)

    def _util_measured(self, on: list[RegisteredJob], now: float) -> bool:
        return all(util_measured(now, self.util.window_s, self.opt.compliance.grace_s,
                                 max(j.registered_unix, self.started_unix), j.first_report_unix)
                   for j in on if j.job_class == "guaranteed")

    def _snapshot(self) -> NodeSnapshot:
        proc_mem = {s.pid: s.memory_bytes for s in self.proc_samples if s.memory_bytes is not None}
        managed: dict[int, int] = {}
        jobs = []
        for job in self.jobs.values():
            demand, iteration, ms, busy = 0, None, None, None
            for a in job.agents.values():
                used = agent_memory(a, proc_mem)
                if a.gpu is not None:
                    managed[a.gpu] = managed.get(a.gpu, 0) + used
                if a.report is not None:
                    r = a.report
                    demand = max(demand, used, r.mem_peak_bytes)
                    iteration = r.iteration if iteration is None else max(iteration, r.iteration)
                    if ms is None or r.iteration_ms > ms:
                        ms, busy = r.iteration_ms, r.busy_ms  # the slowest agent's, both
                else:
                    demand = max(demand, used)
            can_pause = bool(job.agents) and all(p.FEATURE_PAUSE in a.reg.features for a in job.agents.values())
            can_resize = (job.elastic_min is not None and job.preempt is None and not job.paused
                          and any(p.FEATURE_WIDTH in a.reg.features for a in job.agents.values()))
            # Busy time is the device's own measure (CUDA events) only on a GPU node; an emulated
            # agent's is its host clock scaled, which the policy must not read as device time.
            jobs.append(JobInfo(job.job_id, job.job_class, tuple(job.gpus), job.registered_unix, demand, iteration, ms,
                                can_pause=can_pause, elastic_min=job.elastic_min,
                                elastic_gpus=tuple(job.elastic_gpus), can_resize=can_resize,
                                busy_ms=busy if self.telemetry.kind == "nvml" else None,
                                elastic_group=job.elastic_group))
        gpus = tuple(GpuInfo(s.index, s.memory_total_bytes,
                             max(0, s.memory_used_bytes - managed.get(s.index, 0)) if self.telemetry.kind == "nvml" else 0)
                     for s in self.gpu_samples)
        return NodeSnapshot(gpus, tuple(jobs))

    def _run_policy(self, now: float) -> None:
        self._dirty = False
        decision = decide(self._snapshot(), self.policy_state, self.opt.params, now)
        self.policy_state = decision.state
        self.progress = dict(decision.progress)
        if not self.opt.enforce:
            # Observe only: the policy still runs (its state and the slowdowns it measures are
            # reported), but nothing it decides reaches a job.
            decision = replace(decision, limits={j: UNLIMITED for j in decision.limits}, new_preemptions=(),
                               width_changes=())
        for req in decision.new_preemptions:
            job = self.jobs.get(req.job_id)
            if job is None:
                continue
            if self._uplink is not None:
                # The coordinator chooses the victim cluster-wide and requeues it; it answers with a
                # preempt_notice, which is what the agent gets.
                log.warning("job %s: preemption REQUEST to the coordinator: %s", job.job_id, req.reason)
                self._report_now = True
                continue
            job.preempt = req
            log.warning("job %s: PREEMPTION requested (deadline in %.0f s): %s", job.job_id,
                        req.deadline_unix - now, req.reason)
            for a in job.agents.values():
                self._send_preempt(job, a)
        for rec in decision.new_pauses:
            job = self.jobs.get(rec.job_id)
            if job is not None:
                self._pause(job, rec.reason)
        for change in decision.width_changes:
            job = self.jobs.get(change.job_id)
            if job is not None:
                self._change_width(job, change, now)
        for job_id in decision.resumes:
            job = self.jobs.get(job_id)
            if job is not None:
                self._resume(job)
        self._sync_slot_files()  # first, so that new limits carry the pages as they now are
        for job_id, lim in decision.limits.items():
            job = self.jobs.get(job_id)
            if job is None or lim == job.limits:
                continue
            job.limits = lim
            self._send_limits(job, now)
        self._send_slot_changes(now)
        if self.opt.enforce:
            self._apply_caps()
            self._check_compliance(now)
            self._check_width_returns(now)

    def _send_limits(self, job: RegisteredJob, now: float, skip: Optional[AgentConnection] = None,
                     restart_clock: bool = True) -> None:
        """``job.limits`` under a new seq to each of its agents but ``skip``, each with its own idle-slot page.
        ``restart_clock`` False (only a page changed): limits still unacknowledged keep their clock, so a
        neighbour's comings and goings never reset how long a job has ignored its limits."""
        if restart_clock or all(a.acked_seq >= job.seq for a in job.agents.values()):
            job.limits_sent_unix = now
        job.seq += 1
        lim = job.limits
        for a in job.agents.values():
            if a is not skip:
                pin = {"pin_bytes": lim.pin_bytes} if lim.pin_bytes and p.FEATURE_PIN in a.reg.features else {}
                self._send(job.socket, a, p.Limits(seq=job.seq, mem_limit_bytes=lim.mem_limit_bytes,
                                                   compute_share=lim.compute_share, **self._slot_fields(job, a), **pin))

    def _change_width(self, job: RegisteredJob, change: WidthChange, now: float) -> None:
        """Tell the job's launcher (through its agent with the ``width`` feature) to restart its workers on
        ``change.gpus``. The job counts on the new GPUs from now: a GPU it gives up is the guaranteed
        job's at once, and must be left within the preemption grace time (``_check_width_returns``)."""
        # The latest to register: an agent of workers that are going away may not have timed out yet.
        launcher = next((a for a in reversed(job.agents.values()) if p.FEATURE_WIDTH in a.reg.features), None)
        if launcher is None:
            return
        before = list(job.gpus)
        shed = [g for g in before if g not in change.gpus]
        job.width_seq += 1
        job.width_sent_mono = time.monotonic()
        job.gpus = list(change.gpus)
        for g in shed:
            job.shed[g] = (now, now + self.opt.params.grace_s)
        for g in change.gpus:
            job.shed.pop(g, None)  # grown back onto a GPU it had not left yet: nothing to wait for
        self.width_shrinks_total += len(shed)
        self.width_grows_total += len([g for g in change.gpus if g not in before])
        log.warning("job %s: WIDTH %d -> %d, GPU(s) %s -> %s: %s", job.job_id, len(before), len(job.gpus), before,
                    job.gpus, change.reason)
        self._send(job.socket, launcher, p.Width(seq=job.width_seq, gpus=list(job.gpus), reason=change.reason[:4096]))
        self._save(job)
        self._report_now = True

    def _check_width_returns(self, now: float) -> None:
        """A GPU an elastic job was told to give up is back once none of the job's agents maps to it and
        (NVML) none of its processes is on it. One still used after the grace time is the job's
        non-compliance: it is asked to be requeued, as for any other broken rule."""
        for job in self.jobs.values():
            for g, (since, deadline) in list(job.shed.items()):
                on_it = [a for a in job.agents.values() if a.gpu == g]
                pids = set(self.gpu_pids_by_job.get(job.job_id, ()))
                if self.telemetry.kind == "nvml":
                    on_it += [s for s in self.proc_samples if s.gpu == g and s.pid in pids]
                if not on_it:
                    del job.shed[g]
                    self.width_return_s.append(now - since)
                    del self.width_return_s[:-PAUSE_TIMES_KEPT]
                    log.info("job %s: GPU %d given back %.2f s after the width change", job.job_id, g, now - since)
                    continue
                if now < deadline or job.job_id in self.noncompliant or job.preempt is not None:
                    continue
                del job.shed[g]
                self.width_unreturned_total += 1
                why = (f"told to give up GPU {g} (a width change) {now - since:.0f} s ago, and its processes still "
                       f"use it after the grace time ({self.opt.params.grace_s:g} s)")
                self._noncompliant(job, g, why, now)

    def _pause(self, job: RegisteredJob, reason: str) -> None:
        job.pause_seq += 1
        job.paused = True
        job.pause_sent_mono = time.monotonic()
        job.paused_unix = None
        self.pauses_total += 1
        log.warning("job %s: PAUSE in place: %s", job.job_id, reason)
        for a in job.agents.values():
            self._send(job.socket, a, p.Pause(seq=job.pause_seq, reason=reason[:4096]))
        self._report_now = True

    def _resume(self, job: RegisteredJob) -> None:
        if not job.paused:
            return
        job.paused = False
        job.resume_sent_mono = time.monotonic()
        if job.paused_unix is not None:
            self.pause_seconds_total += time.time() - job.paused_unix
        log.warning("job %s: RESUME: its GPU has room again", job.job_id)
        for a in job.agents.values():
            self._send(job.socket, a, p.Resume(seq=job.pause_seq))
        self._report_now = True

    def _apply_caps(self) -> None:
        """Driver caps follow each opportunistic job's memory limit, with compliance's tolerance on top
        (the agent keeps under its limit; the cap stops only a job that does not)."""
        if self.caps is None:
            return
        tol = self.opt.compliance
        for j in self.jobs.values():
            if j.job_class != "opportunistic" or j.limits.mem_limit_bytes is None:
                self._lift_caps(j.job_id)
                continue
            hard = int(j.limits.mem_limit_bytes * (1 + tol.mem_tolerance)) + tol.mem_slack_bytes
            candidates = [a.reg.pid for a in j.agents.values()] + self.gpu_pids_by_job.get(j.job_id, [])
            cgroup = next((c for c in map(lambda pid: self.caps.cgroup_of(j.job_id, pid), candidates) if c), None)
            if cgroup is None:
                continue  # no process of it seen yet: the next tick
            for gpu in j.gpus:
                try:
                    if self.caps.set(j.job_id, gpu, cgroup, hard):
                        log.info("job %s: driver memory cap %d MiB on GPU %d (%s)", j.job_id, hard >> 20, gpu, cgroup)
                except Exception as e:  # noqa: BLE001 - an NVML refusal costs the cap, never the sidecar
                    self.cap_errors += 1
                    self._rlog.warning(f"cap:{j.job_id}", "job %s: could not set its driver memory cap on GPU %d: %s",
                                       j.job_id, gpu, e)

    def _lift_caps(self, job_id: str) -> None:
        if self.caps is None:
            return
        try:
            self.caps.clear(job_id)
        except Exception as e:  # noqa: BLE001
            self.cap_errors += 1
            self._rlog.warning(f"cap:{job_id}", "job %s: could not lift its driver memory cap: %s", job_id, e)

    def _check_compliance(self, now: float) -> None:
        """policy.node.compliance on what this node measures; a non-compliant job is asked to be requeued at
        once (by the coordinator; without one, it is sent a preemption notice, all a sidecar can do)."""
        self.noncompliant = {k: v for k, v in self.noncompliant.items() if k in self.jobs}
        guarded = {g for j in self.jobs.values() if j.job_class == "guaranteed" for g in j.gpus}
        nvml = self.telemetry.kind == "nvml"
        on_gpu = self.gpu_procs_by_job
        checked = []
        for j in self.jobs.values():
            if j.job_class != "opportunistic" or j.paused:
                continue  # a paused job is compliant by definition: it holds nothing and runs nothing
            unacked = any(a.acked_seq < j.seq for a in j.agents.values()) and j.limits_sent_unix is not None
            agent_mem = sum(agent_memory(a, {}) for a in j.agents.values())
            checked.append(compliance.JobCompliance(
                j.job_id, any(g in guarded for g in j.gpus), len(j.agents),
                len(on_gpu.get(j.job_id, ())) if nvml else None, j.limits_sent_unix if unacked else None,
                max(agent_mem, sum(on_gpu.get(j.job_id, ()))), j.limits.mem_limit_bytes))
        bad, self.compliance_since = compliance.step(checked, self.compliance_since, self.opt.compliance, now)
        for job_id, why in bad.items():
            job = self.jobs[job_id]
            if job_id in self.noncompliant or job.preempt is not None:
                continue
            self._noncompliant(job, next((g for g in job.gpus if g in guarded), job.gpus[0] if job.gpus else 0), why, now)

    def _noncompliant(self, job: RegisteredJob, gpu: int, why: str, now: float) -> None:
        """Ask for the job's requeue at once: from the coordinator, which requeues it; without one, a
        preemption notice to its agents, all a sidecar can do."""
        req = PreemptRequest(job.job_id, gpu, why, now, now)
        self.noncompliant[job.job_id] = req
        self.noncompliant_total += 1
        log.warning("job %s: NON-COMPLIANT, asking for its requeue: %s", job.job_id, why)
        if self._uplink is not None:
            self._report_now = True
        else:
            job.preempt = req
            for a in job.agents.values():
                self._send_preempt(job, a)

    def _check_health(self, mono: float, force: bool = False) -> None:
        if not force and mono - self._health_checked < HEALTH_CHECK_S:
            return
        self._health_checked = mono
        paths = [self.dir.state_dir] + ([self.opt.hooks_state_dir] if self.opt.hooks_state_dir else [])
        why = health.node_problem(paths) or device_failure.problem(self.opt.hooks_state_dir, time.time())
        if why != self.unhealthy:
            if why:
                log.error("node %s takes no new opportunistic job: %s", self.opt.node, why)
            else:
                log.warning("node %s takes opportunistic jobs again (was: %s)", self.opt.node, self.unhealthy)
            self.unhealthy = why
            self._report_now = True
