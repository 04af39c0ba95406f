"""The coordinator channel: the node report sent up the uplink (uplink.py) when due or as soon as
something the coordinator acts on changed, and what the coordinator sends down it: a job's new
class, a preemption notice, a checkpoint notice."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Optional

import zmq

from slurm_antman import protocol as p
from slurm_antman.policy.node.core import PolicyState, PreemptRequest

from .records import RegisteredJob
from .uplink import Uplink

log = logging.getLogger("antman.sidecar")


class CoordinatorChannel:
    """Mixed into ``daemon.Sidecar``, which makes this state."""

    jobs: dict[str, RegisteredJob]
    policy_state: PolicyState
    _ctx: zmq.Context
    _poller: zmq.Poller
    _uplink: Optional[Uplink]
    _report_now: bool

    def _open_uplink(self) -> None:
        if self.opt.uplink is not None:
            self._uplink = Uplink(self._ctx, self.opt.uplink, self.opt.node)
            self._uplink.open()
            self._poller.register(self._uplink.socket, zmq.POLLIN)

    def _report_to_coordinator(self, mono: float) -> None:
        if self._uplink is not None and (self._report_now or self._uplink.report_due(mono)):
            self._report_now = False
            self._uplink.send_report(self._node_report(), time.monotonic())

    def _on_coordinator(self, frames: list[bytes]) -> None:
        assert self._uplink is not None
        msg = self._uplink.receive(frames)
        if msg is None:
            return
        b = msg.body
        try:
            if isinstance(b, p.JobClassUpdate):
                self._set_class(b)
            elif isinstance(b, p.PreemptNotice):
                self._coordinator_preempt(b)
            elif isinstance(b, p.CheckpointNotice):
                self._coordinator_checkpoint(b)
            elif isinstance(b, p.Bye):
                log.info("the coordinator said bye: %s", b.reason[:200])
        except p.ProtocolError as e:
            self._uplink.reply_error(e.code, e.message, msg.id)

    def _set_class(self, b: p.JobClassUpdate) -> None:
        job = self._known(b.job_id, "job_class_update")
        self._report_now = True
        if job.job_class == b.job_class:
            return
        log.warning("job %s: class %s -> %s (coordinator)", job.job_id, job.job_class, b.job_class)
        job.job_class = b.job_class
        if b.job_class == "guaranteed":
            job.preempt = None
            self.policy_state = replace(self.policy_state, preempted={
                k: v for k, v in self.policy_state.preempted.items() if k != job.job_id})
        self._save(job)
        self._run_policy(time.time())

    def _coordinator_preempt(self, b: p.PreemptNotice) -> None:
        job = self._known(b.job_id, "preempt_notice")
        if job.job_class != "opportunistic":
            raise p.ProtocolError(p.ErrorCode.bad_value, f"preempt_notice: job {job.job_id} is {job.job_class} on "
                                  f"node {self.opt.node}; only opportunistic jobs are preempted")
        self._report_now = True
        if job.preempt is not None:
            return  # a repeated notice keeps the first deadline
        now = time.time()
        if b.avoid_gpus:
            self._remember_avoid(job.job_id, b.avoid_gpus, now)
        gpu = job.gpus[0] if job.gpus else 0
        req = PreemptRequest(job.job_id, gpu, b.reason, now, now + b.grace_s)
        job.preempt = req
        # The coordinator's victim answers every request on its GPUs; the local policy asks again if
        # the room it frees is not enough.
        on_its_gpus = set(job.gpus)
        kept = {k: v for k, v in self.policy_state.preempted.items()
                if v.gpu not in on_its_gpus or (k in self.jobs and self.jobs[k].preempt is not None)}
        kept[job.job_id] = req
        self.policy_state = replace(self.policy_state, preempted=kept)
        log.warning("job %s: PREEMPTION notice from the coordinator (requeue in %.0f s): %s", job.job_id,
                    b.grace_s, b.reason)
        for a in job.agents.values():
            self._send_preempt(job, a)
        self._run_policy(now)

    def _coordinator_checkpoint(self, b: p.CheckpointNotice) -> None:
        """A sibling task of this job's elastic array leaves in ``at_s`` (or joined now): the agents that
        can checkpoint while training on are asked to, at that moment (docs/elastic.md)."""
        job = self._known(b.job_id, "checkpoint_notice")
        if job.elastic_group is None:
            raise p.ProtocolError(p.ErrorCode.bad_value, f"checkpoint_notice: job {job.job_id} on node "
                                  f"{self.opt.node} is not a task of an elastic array")
        job.checkpoint_seq += 1
        at = time.time() + b.at_s
        able = [a for a in job.agents.values() if p.FEATURE_CHECKPOINT in a.reg.features]
        for a in able:
            self._send(job.socket, a, p.Checkpoint(seq=job.checkpoint_seq, at_unix=at, reason=b.reason))
        log.info("job %s: checkpoint %d asked of %d of its %d agent(s) for %s (in %.1f s): %s", job.job_id,
                 job.checkpoint_seq, len(able), len(job.agents), time.strftime("%H:%M:%S", time.localtime(at)),
                 b.at_s, b.reason[:300])
