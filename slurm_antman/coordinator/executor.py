"""Carries out policy decisions in Slurm (and over the sidecar uplink).

Every step reads the job or node back from Slurm first and does nothing when Slurm already shows
the result, or when the job has moved on (finished, started, requeued by someone else). That makes
each decision idempotent, which is what lets a restarted coordinator replay a cycle safely: a
Requeue whose job's restart count already went up is skipped, never sent twice.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from slurm_antman import protocol as p
from slurm_antman.config import AntmanConfig
from slurm_antman.jobtag import JobTag, TagError
from slurm_antman.policy.cluster import (
    CheckpointNotice, CoordinatorState, HoldForQuota, KeepOff, MakeEligible, PreemptNotice, ReleaseHold, Requeue, SetClass, SetOppSlots, Upgrade,
)
from slurm_antman.slurm import SlurmBackend, SlurmError
from slurm_antman.slurm.models import HELD_BY_ADMIN, REQUEUED_START_TIME, Job
from slurm_antman.slurm.parsing import gres_count, gres_prefix, gres_types, split_gres, tres_body

log = logging.getLogger("antman.coordinator.executor")

# `#SBATCH --signal=[{R|B}:]SIG[@TIME]` (sbatch(1)); submitit and Lightning write it this way.
_SIGNAL_LINE = re.compile(r"^#SBATCH\s+--signal[= ]\s*(?:(?P<flags>[RB]+):)?(?P<sig>[A-Za-z0-9]+)(?:@\d+)?\s*$",
                          re.M)


class Hub(Protocol):
    def send(self, node: str, body: p.Body) -> bool: ...


@dataclass(frozen=True)
class Outcome:
    outcome: str                  # ok | skipped | error
    detail: str = ""
    error: Optional[str] = None
    restarts: Optional[int] = None  # the job's Slurm restart count when the decision was carried out
    # Skipped only because Slurm had not caught up with the snapshot the decision came from: the
    # daemon forgets the decision, so the next cycle makes it again.
    retry: bool = False

    @property
    def failed(self) -> bool:
        return self.outcome == "error"


def ok(detail: str = "", restarts: Optional[int] = None) -> Outcome:
    return Outcome("ok", detail, None, restarts)


def _requeue_in_flight(job: Any) -> bool:
    """squeue said PENDING, scontrol not yet (a requeue still COMPLETING or REQUEUED): neither running nor
    ended, so a decision for a pending job is worth trying again next cycle."""
    return job.state not in ("RUNNING", "CONFIGURING") and not job.finished


def skipped(detail: str, restarts: Optional[int] = None, retry: bool = False) -> Outcome:
    return Outcome("skipped", detail, None, restarts, retry)


def failed(error: str) -> Outcome:
    return Outcome("error", "", error)


def retarget_tres(tres: str, from_names: tuple[str, ...], to_name: str) -> str:
    """TresPerNode with every GPU-like entry folded into one ``gres:TO:N``, in the prefix form the string
    came in (``gres/`` in 24.11). One GPU type stays (``gres:TO:h100:N``): a typed node group's
    opportunistic slots are typed too, so the job keeps to nodes of its type either way."""
    count = gres_count(tres, from_names)
    kept = [e for e in filter(None, (tres or "").split(",")) if tres_body(e).split(":")[0] not in from_names]
    types = gres_types(tres, from_names)
    typed = f"{next(iter(types))}:" if len(types) == 1 else ""
    return ",".join([*kept, f"{gres_prefix(tres)}{to_name}:{typed}{max(count, 1)}"])


def job_signal(script: str) -> Optional[tuple[str, bool]]:
    """The ``--signal`` a batch script asks for: (signal, batch shell only)."""
    m = None
    for m in _SIGNAL_LINE.finditer(script):
        pass  # sbatch lets the last one win
    if m is None:
        return None
    sig = m.group("sig").upper()
    return sig.removeprefix("SIG") if not sig.isdigit() else sig, "B" in (m.group("flags") or "")


class Executor:
    """``execute(decision, state)`` -> :class:`Outcome`; never raises for a Slurm or sidecar failure."""

    def __init__(self, backend: SlurmBackend, config: AntmanConfig, hub: Optional[Hub] = None,
                 clock: Callable[[], float] = None):  # type: ignore[assignment]
        import time

        self.backend = backend
        self.cfg = config
        self.hub = hub
        self.clock = clock or time.time
        names = config.slurm
        self.gpu_names = (names.gpu_gres, names.opportunistic_gres)

    # -- entry point -------------------------------------------------------------------------
    def execute(self, decision: Any, state: Optional[CoordinatorState] = None) -> Outcome:
        handler = getattr(self, "_" + decision.kind, None)
        if handler is None:
            return failed(f"no executor for decision kind {decision.kind!r}")
        try:
            return handler(decision, state)
        except SlurmError as e:
            return failed(str(e))
        except (TagError, ValueError) as e:
            return failed(f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - a bug costs one decision (audited), not the daemon
            log.exception("executing %s failed", decision.kind)
            return failed(f"internal error: {type(e).__name__}: {e}")

    # -- helpers -----------------------------------------------------------------------------
    def _job(self, job_id: str) -> Job:
        return self.backend.job(int(job_id))

    @staticmethod
    def _tag(job: Job) -> JobTag:
        tag = job.checked_tag()
        if tag is None:
            raise TagError(f"job {job.job_id} carries no slurm-antman tag in AdminComment "
                           f"({job.admin_comment or 'empty'}); it is plain Slurm and not the coordinator's to change")
        return tag

    def _send(self, node: str, body: p.Body) -> bool:
        if self.hub is None:
            return False
        try:
            return self.hub.send(node, body)
        except Exception as e:  # noqa: BLE001 - an uplink problem must not stop a Slurm action
            log.warning("sending %s to node %s failed: %s", body.TYPE, node, e)
            return False

    # -- decisions ---------------------------------------------------------------------------
    def _set_class(self, d: SetClass, state: Any) -> Outcome:
        job = self._job(d.job_id)
        if job.state != "PENDING":
            return skipped(f"job is {job.state}, no longer pending; its class stays {job.antman_class}")
        tag = self._tag(job)
        held = tag.hold == "quota"
        if tag.job_class == d.to_class and not (d.release_hold and held):
            return skipped(f"already {d.to_class}")
        s = self.cfg.slurm
        if tag.job_class != d.to_class and gres_count(job.tres_per_node, self.gpu_names) > 0:
            # Slurm 22.05 shows a new TresPerNode on a pending job but keeps scheduling it by the GRES
            # it was submitted with (docs/architecture.md). Changing tag and partition alone would make
            # a job whose class and GPUs disagree, e.g. a "guaranteed" job with no physical GPU. It
            # keeps its class; a running opportunistic job is upgraded in place later instead.
            if d.release_hold and held:
                return ok("class kept (Slurm 22.05 cannot move a pending job between GRES); "
                          + ", ".join(self._unhold(job, tag)))
            return skipped(f"pending GPU job keeps class {tag.job_class}: Slurm 22.05 cannot move it from the "
                           f"{s.gpu_gres if tag.job_class == 'guaranteed' else s.opportunistic_gres} GRES")
        new_tag = tag.with_class(d.to_class)
        if d.release_hold:
            new_tag = new_tag.with_hold(None)
        fields: dict[str, Any] = {"AdminComment": new_tag.render()}
        if tag.job_class != d.to_class:
            if d.to_class == "opportunistic":
                fields.update(TresPerNode=retarget_tres(job.tres_per_node, self.gpu_names, s.opportunistic_gres),
                              Partition=s.opportunistic_partition, Requeue=1)
                if s.opportunistic_qos:
                    fields["QOS"] = s.opportunistic_qos
            else:
                fields.update(TresPerNode=retarget_tres(job.tres_per_node, self.gpu_names, s.gpu_gres),
                              Partition=s.guaranteed_partition)
        self.backend.update(job.slurm_id, **fields)
        if d.release_hold and job.reason == HELD_BY_ADMIN:
            self.backend.release(job.slurm_id)
        return ok(" ".join(f"{k}={v}" for k, v in fields.items()))

    def _hold_for_quota(self, d: HoldForQuota, state: Any) -> Outcome:
        job = self._job(d.job_id)
        if job.state != "PENDING":
            return skipped(f"job is {job.state}, no longer pending")
        tag = self._tag(job)
        if tag.hold == "quota" and job.reason == HELD_BY_ADMIN:
            return skipped("already held for quota")
        # One RPC: Priority=0 is Slurm's admin hold, and the tag says whose hold it is.
        comment = tag.with_hold("quota").render()
        self.backend.update(job.slurm_id, Priority=0, AdminComment=comment)
        return ok(f"Priority=0 AdminComment={comment}")

    def _release_hold(self, d: ReleaseHold, state: Any) -> Outcome:
        job = self._job(d.job_id)
        done = self._unhold(job, self._tag(job))
        return ok(", ".join(done)) if done else skipped("not held for quota")

    def _unhold(self, job: Any, tag: Any) -> list[str]:
        """Release our quota hold and clear its mark in the tag; what was done, for the audit log."""
        done = []
        if job.state == "PENDING" and job.reason == HELD_BY_ADMIN and tag.hold == "quota":
            self.backend.release(job.slurm_id)
            done.append("released")
        if tag.hold is not None:
            comment = tag.with_hold(None).render()
            self.backend.update(job.slurm_id, AdminComment=comment)
            done.append(f"AdminComment={comment}")
        return done

    def _set_opp_slots(self, d: SetOppSlots, state: Any) -> Outcome:
        opp = self.cfg.slurm.opportunistic_gres
        node = next((n for n in self.backend.nodes() if n.name == d.node), None)
        if node is None:
            return failed(f"node {d.node} is not in sinfo")
        current = node.gres.get(opp)
        if current == d.slots:
            return skipped(f"{opp} already {d.slots}")
        raw = str(node.raw.get("gres") or "")
        # scontrol's Gres= replaces the node's whole list. A node that has not registered yet (slurmctld
        # just started, slurmd not up) shows none: writing our one entry then would take its GPUs away
        # (seen 2026-11-29: a coordinator started within a second of slurmctld left a node with
        # Gres=antman_opp:2 and no gpu, and every GPU job was refused).
        if current is None:
            return skipped(f"node {d.node} shows no {opp} yet (GRES {raw or 'none'}): not registered; next cycle")
        # sinfo may append "(S:0-1)" socket info to a GPU entry; scontrol does not take it back
        entries = [re.sub(r"\(.*\)$", "", e) for e in split_gres(raw)]
        # A typed node group's slots are typed (antman_opp:h100:N): the type stays, or typed jobs lose the node.
        mine = [e.split(":") for e in entries if e.split(":")[0] == opp]
        typed = f"{mine[0][1]}:" if mine and len(mine[0]) == 3 else ""
        entries = [e for e in entries if e.split(":")[0] != opp]
        gres = ",".join([*entries, f"{opp}:{typed}{d.slots}"])
        self.backend.update_node(d.node, Gres=gres)
        return ok(f"Gres={gres} (was {opp}:{current})")

    def _upgrade(self, d: Upgrade, state: Any) -> Outcome:
        job = self._job(d.job_id)
        if job.state != "RUNNING":
            return skipped(f"job is {job.state}, not running")
        tag = self._tag(job)
        nodes = job.nodes or list(tag.gpus)
        if tag.job_class == "guaranteed":
            return skipped("already guaranteed", job.restarts)
        # The sidecar first: if it cannot be told, nothing changes and the next cycle tries again,
        # rather than Slurm calling a job guaranteed that its node still throttles.
        unreached = [n for n in nodes if not self._send(n, p.JobClassUpdate(job_id=d.job_id, job_class="guaranteed"))]
        if unreached:
            return failed(f"sidecar of node(s) {', '.join(unreached)} not reachable; job stays opportunistic")
        comment = tag.with_class("guaranteed").render()
        self.backend.update(job.slurm_id, AdminComment=comment)
        return ok(f"AdminComment={comment}; job_class_update sent to {', '.join(nodes)}", job.restarts)

    def _preempt_notice(self, d: PreemptNotice, state: Any) -> Outcome:
        job = self._job(d.job_id)
        if job.state != "RUNNING":
            return skipped(f"job is {job.state}, not running", job.restarts)
        gpu = d.inputs.get("gpu")
        avoid = [gpu] if isinstance(gpu, int) and not isinstance(gpu, bool) and 0 <= gpu <= 1023 else None
        sent = self._send(d.node, p.PreemptNotice(job_id=d.job_id, grace_s=float(d.grace_s), reason=d.reason[:1000],
                                                  avoid_gpus=avoid))
        notes = [f"preempt_notice {'sent to' if sent else 'NOT delivered to'} {d.node}'s sidecar"]
        sig = self._signal_of(job)
        if sig is not None:
            name, batch_only = sig
            self.backend.signal(job.slurm_id, name, batch_only=batch_only)
            notes.append(f"signal {name} sent to the {'batch step' if batch_only else 'job'}")
        else:
            # No --signal of its own: no early SIGTERM either. A job killed by it before the deadline
            # would end (not be requeued) and be lost; Slurm's requeue sends SIGTERM itself.
            notes.append("job has no --signal; Slurm's requeue will send SIGTERM")
        notes.append(f"requeue in {d.grace_s:g} s")
        return ok("; ".join(notes), job.restarts)

    def _checkpoint_notice(self, d: CheckpointNotice, state: Any) -> Outcome:
        job = self._job(d.job_id)
        if job.state != "RUNNING":
            return skipped(f"job is {job.state}, not running", job.restarts)
        sent = self._send(d.node, p.CheckpointNotice(job_id=d.job_id, at_s=float(d.at_s), reason=d.reason[:1000]))
        if not sent:
            return failed(f"checkpoint_notice not delivered to {d.node}'s sidecar")
        return ok(f"checkpoint_notice sent to {d.node}'s sidecar (checkpoint in {d.at_s:g} s)", job.restarts)

    def _signal_of(self, job: Job) -> Optional[tuple[str, bool]]:
        try:
            script = self.backend.batch_script(job.slurm_id)
        except SlurmError as e:
            log.info("job %s: cannot read its batch script for --signal: %s", job.job_id, e)
            return None
        return job_signal(script)

    @staticmethod
    def _expected_restarts(job_id: str, state: Any) -> Optional[int]:
        for table in ("requeued", "preempting"):
            entry = getattr(state, table, {}).get(job_id) if state is not None else None
            if entry is not None:
                return int(entry.restarts_at_decision)
        return None

    def _requeue(self, d: Requeue, state: Any) -> Outcome:
        job = self._job(d.job_id)
        expected = self._expected_restarts(d.job_id, state)
        if expected is not None and job.restarts != expected:
            return skipped(f"restart count is {job.restarts}, was {expected} at the decision: "
                           "already requeued, not again", job.restarts)
        if job.state not in ("RUNNING", "SUSPENDED", "CONFIGURING"):
            return skipped(f"job is {job.state}; nothing to requeue", job.restarts)
        self.backend.requeue(job.slurm_id)
        return ok(f"scontrol requeue (Restarts {job.restarts} -> {job.restarts + 1})", job.restarts)

    def _keep_off(self, d: KeepOff, state: Any) -> Outcome:
        job = self._job(d.job_id)
        if job.state != "PENDING":
            # A job the Prolog refused and requeued is COMPLETING for a moment under 24.11, then pending
            # with no exclusion: retry, or it starts on the node with no room again (as make_eligible).
            # RUNNING too: the snapshot saw it pending, Slurm started it in the same second on the node
            # with no room, and its Prolog is about to requeue it; without a retry the core's in-flight
            # record held the next KeepOff back for a minute (seen in make test). A job that really runs
            # gets no KeepOff from the core, so the retry costs nothing then.
            return skipped(f"job is {job.state}; ExcNodeList can only change while it is pending", job.restarts,
                           retry=not job.finished)
        if job.antman_class != "opportunistic":
            return skipped(f"job is {job.antman_class}, not opportunistic", job.restarts)
        self.backend.update(job.slurm_id, ExcNodeList=",".join(d.nodes))
        return ok(f"ExcNodeList={','.join(d.nodes) or '(none)'}", job.restarts)

    def _make_eligible(self, d: MakeEligible, state: Any) -> Outcome:
        job = self._job(d.job_id)
        if job.state != "PENDING":
            # Try again next cycle, or the job would sit out Slurm's whole BeginTime wait.
            return skipped(f"job is {job.state}", job.restarts, retry=_requeue_in_flight(job))
        # A requeued job waits ~121 s (Reason=BeginTime); this lifts that (models.REQUEUED_START_TIME), or
        # sets the hold of a task an elastic array shed. slurmctld reads a bare date in its own local time.
        at = REQUEUED_START_TIME
        if d.start_unix is not None and d.start_unix > time.time() + 2:
            at = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(d.start_unix))
        self.backend.update(job.slurm_id, StartTime=at)
        return ok(f"StartTime={at}", job.restarts)
