"""The agent channel: what a job's agents send on its socket (register, report, ack, paused, resumed,
bye) and what the sidecar sends them; silent agents dropped, the others kept alive by heartbeats."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Optional

import zmq

from slurm_antman import protocol as p

from . import peers
from .records import AgentConnection, RegisteredJob

log = logging.getLogger("antman.sidecar")

AGENT_TIMEOUT_HEARTBEATS = 5
PAUSE_TIMES_KEPT = 256
# An agent is one training process; a few per GPU covers every launcher seen (one per rank).
MAX_AGENTS_PER_GPU = 8


class AgentChannel:
    """Mixed into ``daemon.Sidecar``, which makes this state."""

    _peer: Optional[peers.Peer]
    _dirty: bool
    pause_bytes_moved_total: int
    pause_ack_ms: list[float]
    resume_ack_ms: list[float]

    def _on_agent(self, job: RegisteredJob, frames: list[bytes]) -> None:
        identity, delim, rest = self._split(frames)
        route = [identity, *delim]
        try:
            msg = p.decode(rest, p.AGENT_TO_SIDECAR)
        except p.ProtocolError as e:
            self._protocol_error(f"job {job.job_id} agent", job.socket, route, e)
            return
        mono = time.monotonic()
        b = msg.body
        agent = job.agents.get(identity)
        if agent is not None:
            agent.last_seen = mono
        if isinstance(b, p.Register):
            self._register_agent(job, identity, msg, mono)
        elif isinstance(b, p.Bye):
            if job.agents.pop(identity, None) is not None:
                log.info("job %s: agent pid %d left (%s)", job.job_id, agent.reg.pid, b.reason[:200])
                self._dirty = True
        elif isinstance(b, p.Error):
            self._rlog.warning(f"agent-error:{b.code}", "job %s: agent reports error %s: %s",
                               job.job_id, b.code, b.message[:500])
        elif agent is None:
            self._protocol_error(f"job {job.job_id} agent", job.socket, route, p.ProtocolError(
                p.ErrorCode.not_registered, f"send 'register' before {msg.type!r} (the sidecar may have restarted)",
                msg.id))
        elif isinstance(b, p.Report):
            agent.report = b
            agent.report_unix = time.time()
            if job.first_report_unix is None:
                job.first_report_unix = agent.report_unix
            self._dirty = True
        elif isinstance(b, p.Ack):
            agent.acked_seq = max(agent.acked_seq, b.seq)
        elif isinstance(b, p.Paused):
            if b.seq == job.pause_seq and job.paused and job.paused_unix is None:
                job.paused_unix = time.time()
                self.pause_bytes_moved_total += b.bytes_moved
                if job.pause_sent_mono is not None:
                    self.pause_ack_ms.append((time.monotonic() - job.pause_sent_mono) * 1000.0)
                    del self.pause_ack_ms[:-PAUSE_TIMES_KEPT]
                log.info("job %s: paused: %d MiB moved to host memory, %d MiB of GPU memory freed (%.1f ms in the agent)",
                         job.job_id, b.bytes_moved >> 20, b.bytes_freed >> 20, b.pause_ms)
            self._dirty = True
        elif isinstance(b, p.WidthDone):
            if b.seq == job.width_seq and job.width_sent_mono is not None:
                log.info("job %s: width change %d checkpointed (%.1f ms in the agent, %.1f ms since it was sent); "
                         "its launcher restarts the workers on GPU(s) %s", job.job_id, b.seq, b.checkpoint_ms,
                         (time.monotonic() - job.width_sent_mono) * 1000.0, job.gpus)
        elif isinstance(b, p.CheckpointDone):
            if b.seq == job.checkpoint_seq:
                log.info("job %s: agent pid %d checkpointed for request %d (%.1f ms, %.1f s from the moment asked)",
                         job.job_id, agent.reg.pid, b.seq, b.checkpoint_ms, b.late_ms / 1000.0)
        elif isinstance(b, p.Resumed):
            if b.seq == job.pause_seq and job.resume_sent_mono is not None:
                self.resume_ack_ms.append((time.monotonic() - job.resume_sent_mono) * 1000.0)
                del self.resume_ack_ms[:-PAUSE_TIMES_KEPT]
                job.resume_sent_mono = None
            log.info("job %s: resumed (%.1f ms in the agent)", job.job_id, b.resume_ms)

    def _register_agent(self, job: RegisteredJob, identity: bytes, msg: p.Message, mono: float) -> None:
        reg: p.Register = msg.body
        route = [identity]
        if reg.job_id != job.job_id:
            self._protocol_error(f"job {job.job_id} agent", job.socket, route, p.ProtocolError(
                p.ErrorCode.forbidden, f"this endpoint serves job {job.job_id}, not job {reg.job_id}", msg.id))
            return
        host_pid, refused = peers.check(self._peer, reg.pid, job.job_id, job.uid)
        if refused:
            self._protocol_error(f"job {job.job_id} agent", job.socket, route, p.ProtocolError(
                p.ErrorCode.forbidden, refused, msg.id))
            return
        if host_pid != reg.pid:
            reg = replace(reg, pid=host_pid)  # NVML and /proc know the process by this one
        if reg.job_class not in ("none", job.job_class):
            log.warning("job %s: agent believes class %s, sidecar has %s; the sidecar's class applies",
                        job.job_id, reg.job_class, job.job_class)
        cap = MAX_AGENTS_PER_GPU * max(1, len(job.gpus))
        if identity not in job.agents and len(job.agents) >= cap:
            # Each agent costs the sidecar memory and a share of every tick; a job may not flood it.
            self._protocol_error(f"job {job.job_id} agent", job.socket, route, p.ProtocolError(
                p.ErrorCode.forbidden, f"job {job.job_id} already has {len(job.agents)} agents registered, the most "
                f"a job with {len(job.gpus)} GPU(s) on this node may have ({MAX_AGENTS_PER_GPU} per GPU)", msg.id))
            return
        gpu = job.gpus[reg.local_rank % len(job.gpus)] if job.gpus else None
        # `registered` carries the job's current limits, so they count as acknowledged.
        agent = AgentConnection(identity, reg, gpu, last_seen=mono, last_sent=mono, acked_seq=job.seq)
        job.agents[identity] = agent
        log.info("job %s: agent pid %d rank %d registered (%s, torch %s)", job.job_id, reg.pid, reg.rank,
                 reg.device, reg.torch_version)
        # An agent that can publish may make its GPU's page, which its neighbours' agents then hear of;
        # this one hears of its page in `registered` (whose seq it then holds, whatever the others got).
        self._sync_slot_files()
        self._send_slot_changes(time.time(), skip=agent)
        agent.acked_seq = job.seq
        throttle = "off" if job.job_class == "guaranteed" else self.opt.opportunistic_throttle
        self._send(job.socket, agent, p.Registered(
            job_id=job.job_id, job_class=job.job_class, seq=job.seq, mem_limit_bytes=job.limits.mem_limit_bytes,
            compute_share=job.limits.compute_share, heartbeat_s=self.opt.heartbeat_s, throttle=throttle,
            **self._slot_fields(job, agent)), ref=msg.id)
        if job.preempt is not None:
            self._send_preempt(job, agent)
        elif job.paused and p.FEATURE_PAUSE in reg.features:
            # An agent that joins a paused job (a new rank, a restarted process) pauses with it.
            self._send(job.socket, agent, p.Pause(seq=job.pause_seq, reason="the job is paused in place"))
        self._catch_up_width(job, agent)

    def _catch_up_width(self, job: RegisteredJob, agent: AgentConnection) -> None:
        """A launcher's agent that registers at another width than the job's (its workers restarted
        before the width change reached them, or the sidecar restarted) is told the job's width again.
        By width, not by list: under ConstrainDevices the job names its GPUs 0..n-1, not physically."""
        if job.elastic_min is None or job.width_seq == 0 or p.FEATURE_WIDTH not in agent.reg.features:
            return
        if agent.reg.world_size != len(job.gpus):
            self._send(job.socket, agent, p.Width(seq=job.width_seq, gpus=list(job.gpus),
                                                  reason="the job's width changed while its workers restarted"))

    def _send(self, sock: Optional[zmq.Socket], agent: AgentConnection, body: p.Body, ref: Optional[str] = None) -> None:
        if sock is None:
            return
        agent.last_sent = time.monotonic()
        self._reply_raw(sock, [agent.identity], p.Message(body=body, ref=ref))

    def _send_preempt(self, job: RegisteredJob, agent: AgentConnection) -> None:
        assert job.preempt is not None
        grace = max(0.0, job.preempt.deadline_unix - job.preempt.requested_unix)
        self._send(job.socket, agent, p.Preempt(deadline_unix=job.preempt.deadline_unix,
                                                grace_s=grace, reason=job.preempt.reason))

    def _heartbeat_agents(self, mono: float) -> None:
        expire_before = mono - AGENT_TIMEOUT_HEARTBEATS * self.opt.heartbeat_s
        for job in self.jobs.values():
            for ident, a in list(job.agents.items()):
                if a.last_seen < expire_before:
                    del job.agents[ident]
                    log.warning("job %s: agent pid %d silent for %.0f s; no longer counted", job.job_id,
                                a.reg.pid, mono - a.last_seen)
                elif mono - a.last_sent >= self.opt.heartbeat_s:
                    self._send(job.socket, a, p.Heartbeat())
