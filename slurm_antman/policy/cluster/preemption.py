"""Preemption: pick a victim for each new need, requeue it when its grace time is over, and make the
requeued job eligible again at once. The state makes every step happen once per job and restart.

A task of an elastic-across-nodes array (``JobView.elastic_group``; docs/elastic.md, "Across nodes")
is a victim like any job, and its requeue is the job's shrink: the other tasks re-rendezvous and train
on. It is made eligible again only after ``PolicyParams.elastic_hold_s`` (the grow back waits the hold).
The task that hosts the rendezvous is different: the training cannot outlive it, so choosing it
preempts every running task of its array, and those are made eligible at once (a whole-job requeue)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Optional

from .decisions import Decision, MakeEligible, PreemptNotice, Requeue
from .model import (
    CoordinatorState, GpuView, JobView, NodeView, PolicyParams, Preemption, PreemptNeed, Requeued,
)

# A requeued job that still waits on a BeginTime this long after its MakeEligible asked it to start is
# sent another: on Slurm 26.05 a slow node's requeue can finish after the job already shows PENDING with
# its restart counted, and slurmctld then sets the ~121 s wait again ("Requeuing" logged about 5 s after
# the MakeEligible, in a User-Mode Linux guest, 2026-11-28). A few times at most: a job an admin holds
# back on purpose is not fought over.
BEGIN_WAIT_RECHECK_S = 10.0
MAKE_ELIGIBLE_AT_MOST = 3

# Once a job is in one of these it will not run again under this id, so nothing more is owed to it.
TERMINAL_STATES = frozenset({
    "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
    "PREEMPTED", "SPECIAL_EXIT",
})


@dataclass(slots=True)
class PreemptionOutcome:
    decisions: list[Decision]
    preempting: dict[str, Preemption]
    requeued: dict[str, Requeued]
    touched: set[str]  # jobs that got a decision here: no other decision for them this cycle


def lost_gpu_seconds(job: JobView, now: float) -> float:
    """Work thrown away by requeueing ``job`` now: GPU-seconds since its last checkpoint (or start)."""
    since = job.last_checkpoint_unix if job.last_checkpoint_unix is not None else job.start_unix
    if since is None:
        return 0.0
    return job.gpus * max(0.0, now - since)


def taken_down(job: JobView, jobs: Mapping[str, JobView]) -> list[JobView]:
    """What requeueing ``job`` takes down: itself, or for an elastic array's rendezvous host every
    running task of the array."""
    if not (job.elastic_group and job.elastic_host):
        return [job]
    return [job] + sorted((j for j in jobs.values() if j.elastic_group == job.elastic_group and j is not job
                           and j.state == "RUNNING" and j.job_class == "opportunistic"), key=lambda j: j.job_id)


def _victim_key(job: JobView, jobs: Mapping[str, JobView], now: float) -> tuple:
    # Fewest lost GPU-seconds, then the youngest (latest start), then the id for a stable choice.
    start = job.start_unix if job.start_unix is not None else now
    return (sum(lost_gpu_seconds(j, now) for j in taken_down(job, jobs)), -start, len(job.job_id), job.job_id)


def _find_gpu(node: Optional[NodeView], index: int) -> Optional[GpuView]:
    if node is None or node.last_report_unix is None:
        return None
    for g in node.gpus:
        if g.index == index:
            return g
    return None


def step(now: float, needs: tuple[PreemptNeed, ...], state: CoordinatorState, params: PolicyParams,
         jobs: Mapping[str, JobView], nodes: Mapping[str, NodeView]) -> PreemptionOutcome:
    out = PreemptionOutcome([], {}, {}, set())
    _advance_preempting(now, state, jobs, out)
    _advance_requeued(now, state, params, jobs, out)
    _answer_needs(now, needs, params, jobs, nodes, out)
    return out


def notice_stands(p: Preemption, restarts: int, state: str, job_class: str) -> bool:
    """Whether the job of notice ``p``, now with these restarts, state and class, is still ours to requeue:
    restart safety, a job that restarted, ended or stopped being opportunistic since the notice is not.
    A job whose notice stands is left to this step (the moves step passes it by)."""
    return restarts == p.restarts_at_decision and state == "RUNNING" and job_class == "opportunistic"


def _advance_preempting(now: float, state: CoordinatorState, jobs: Mapping[str, JobView],
                        out: PreemptionOutcome) -> None:
    for p in state.preempting.values():
        job = jobs.get(p.job_id)
        if job is None or not notice_stands(p, job.restarts, job.state, job.job_class):
            continue
        if now < p.deadline_unix:
            out.preempting[p.job_id] = p
            continue
        out.decisions.append(Requeue(
            p.job_id,
            reason=f"grace time of {p.deadline_unix - p.decided_unix:g} s after the preemption notice is over",
            inputs={"node": p.node, "gpu": p.gpu, "for_job": p.for_job_id, "notice_unix": p.decided_unix,
                    "deadline_unix": p.deadline_unix, "restarts": job.restarts, "now": now},
        ))
        out.touched.add(p.job_id)
        out.requeued[p.job_id] = Requeued(p.job_id, p.node, p.gpu, p.for_job_id, now, p.restarts_at_decision)


def _training_on(job: JobView, jobs: Mapping[str, JobView]) -> bool:
    """A shed task of an elastic array whose host still runs: the job trains on without it."""
    return bool(job.elastic_group) and not job.elastic_host and any(
        j.elastic_group == job.elastic_group and j.elastic_host and j.state == "RUNNING" for j in jobs.values())


def _make_eligible(now: float, r: Requeued, job: JobView, params: PolicyParams, jobs: Mapping[str, JobView],
                   out: PreemptionOutcome, again: bool) -> Requeued:
    inputs = {"restarts": job.restarts, "requeued_unix": r.requeued_unix, "for_job": r.for_job_id}
    if again:
        inputs["sent_before"] = r.eligible_sent
    # Sent again, it is past any hold: the recheck waits until after the time the first one set.
    at = r.requeued_unix + params.elastic_hold_s if not again and _training_on(job, jobs) else None
    if at is not None:
        out.decisions.append(MakeEligible(
            r.job_id, start_unix=at, inputs={**inputs, "elastic_group": job.elastic_group},
            reason=f"a task that elastic array {job.elastic_group} shed: it may start again (the job "
                   f"grows back) {params.elastic_hold_s:g} s after its requeue, the hold"))
    else:
        out.decisions.append(MakeEligible(r.job_id, inputs=inputs, reason=(
            "requeued by the coordinator, and Slurm set its BeginTime wait again after it was made eligible "
            "(its requeue finished late): start it now" if again else
            "requeued by the coordinator: start it without Slurm's BeginTime wait")))
    out.touched.add(r.job_id)
    return replace(r, made_eligible=True, eligible_sent=r.eligible_sent + 1,
                   eligible_unix=max(at, now) if at is not None else now)


def _advance_requeued(now: float, state: CoordinatorState, params: PolicyParams, jobs: Mapping[str, JobView],
                      out: PreemptionOutcome) -> None:
    for r in state.requeued.values():
        job = jobs.get(r.job_id)
        if job is None or job.state in TERMINAL_STATES:
            continue
        if job.restarts <= r.restarts_at_decision:
            out.requeued[r.job_id] = r  # Slurm has not shown the requeue yet
            continue
        if job.restarts > r.restarts_at_decision + 1:
            # Requeued again since ours (its Prolog found no room where Slurm started it, between two
            # snapshots): it ran, so ours is done, and holding on would keep the keep-off's own
            # MakeEligible from it for Slurm's whole BeginTime wait (seen on the devcluster: 121 s).
            continue
        if job.state == "PENDING":
            if not r.made_eligible:
                r = _make_eligible(now, r, job, params, jobs, out, again=False)
            elif (job.begin_wait and r.eligible_sent < MAKE_ELIGIBLE_AT_MOST
                  and now >= r.eligible_unix + BEGIN_WAIT_RECHECK_S):
                r = _make_eligible(now, r, job, params, jobs, out, again=True)
            out.requeued[r.job_id] = r
        elif job.state not in ("RUNNING", "CONFIGURING"):
            # COMPLETING (its Epilog still runs) or REQUEUED: Slurm counted the restart before the
            # job is PENDING again; keep watching so it still gets its MakeEligible.
            out.requeued[r.job_id] = r
        # Running again: we are done with it.


def _served(out: PreemptionOutcome, nodes: Mapping[str, NodeView]) -> set[tuple[str, int, str]]:
    """Needs somebody is already being preempted for, or whose victim the sidecar still shows."""
    served = {(p.node, p.gpu, p.for_job_id) for p in out.preempting.values()}
    for r in out.requeued.values():
        gpu = _find_gpu(nodes.get(r.node), r.gpu)
        if gpu is not None and r.job_id in gpu.opportunistic_jobs:
            served.add((r.node, r.gpu, r.for_job_id))
    return served


def _answer_needs(now: float, needs: tuple[PreemptNeed, ...], params: PolicyParams, jobs: Mapping[str, JobView],
                  nodes: Mapping[str, NodeView], out: PreemptionOutcome) -> None:
    if not needs:
        return
    served = _served(out, nodes)
    for need in sorted(needs, key=lambda n: (n.since_unix, n.node, n.gpu, n.job_id)):
        key = (need.node, need.gpu, need.job_id)
        if key in served and not need.victim:  # a named victim is owed its requeue whatever else is on
            continue
        owner = jobs.get(need.job_id)
        gpu = _find_gpu(nodes.get(need.node), need.gpu)
        if owner is None or owner.job_class != "guaranteed" or gpu is None:
            continue  # only a known guaranteed job on a reported GPU may claim room back
        candidates = [
            j for j in (jobs.get(jid) for jid in gpu.opportunistic_jobs)
            if j is not None and j.state == "RUNNING" and j.job_class == "opportunistic"
            and j.job_id not in out.preempting and j.job_id not in out.requeued and j.job_id not in out.touched
        ]
        grace = params.grace_s
        if need.victim:
            # Non-compliant (slurm_antman.policy.node.compliance): this job, at once; it ignored what a notice would ask.
            candidates = [j for j in candidates if j.job_id == need.victim]
            grace = 0.0
        if not candidates:
            continue
        victim = min(candidates, key=lambda j: _victim_key(j, jobs, now))
        lost = sum(lost_gpu_seconds(j, now) for j in taken_down(victim, jobs))
        why = (f"non-compliant beside guaranteed job {need.job_id} on {need.node} GPU {need.gpu}: {need.reason}; "
               "requeued at once" if need.victim else
               f"guaranteed job {need.job_id} on {need.node} GPU {need.gpu} needs room that shrinking "
               f"cannot free ({need.reason}); this job loses the fewest GPU-seconds ({lost:.0f})")
        if victim.elastic_group:
            why += (f"; it hosts elastic array {victim.elastic_group}'s rendezvous, so every running task of the "
                    "array goes with it" if victim.elastic_host else
                    f"; a task of elastic array {victim.elastic_group}: the other tasks train on without it")
        for j in taken_down(victim, jobs):
            if j.job_id in out.preempting or j.job_id in out.requeued or j.job_id in out.touched:
                continue
            node, gpu = (need.node, need.gpu) if j is victim else (j.node or need.node, -1)
            out.decisions.append(PreemptNotice(
                j.job_id, node, grace,
                reason=why if j is victim else f"task of elastic array {j.elastic_group}, whose rendezvous host "
                                               f"{victim.job_id} is preempted: {why}",
                inputs={"node": need.node, "gpu": need.gpu, "for_job": need.job_id, "need_reason": need.reason,
                        "need_since_unix": need.since_unix, "lost_gpu_seconds": lost,
                        "candidates": {c.job_id: round(lost_gpu_seconds(c, now), 3) for c in candidates}},
            ))
            out.touched.add(j.job_id)
            out.preempting[j.job_id] = Preemption(j.job_id, node, now, now + grace, j.restarts, need.reason, gpu,
                                                  need.job_id)
        served.add(key)
