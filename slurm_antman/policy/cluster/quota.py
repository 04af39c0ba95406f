"""Tenant quotas: resolve ``auto``, hold guaranteed jobs that would exceed their tenant's quota (or send
them opportunistic after a wait), release holds, and upgrade running opportunistic jobs.

One pass in submission order over everything that wants guaranteed GPUs, pending or running
opportunistic alike, so freed quota goes to whoever asked first.
"""

from __future__ import annotations

from typing import Collection, Mapping, Optional

from .decisions import Decision, HoldForQuota, ReleaseHold, SetClass, Upgrade
from .model import HOLDING_STATES, GpuView, JobView, NodeView, PolicyParams

WANTS_GUARANTEED = frozenset({"guaranteed", "auto"})


def usage_by_account(jobs: Collection[JobView]) -> dict[str, int]:
    """GPUs each account holds as guaranteed right now (jobs that have their allocation)."""
    used: dict[str, int] = {}
    for j in jobs:
        if j.job_class == "guaranteed" and j.state in HOLDING_STATES:
            used[j.account] = used.get(j.account, 0) + j.gpus
    return used


def _reported_gpus(job: JobView, nodes: Mapping[str, NodeView]) -> list[tuple[str, GpuView]]:
    """(node, GPU) for every GPU the sidecars of the job's nodes show it on; none unless every node the
    job holds reports (a multi-node job's GPUs on a silent node could share a guaranteed job)."""
    out: list[tuple[str, GpuView]] = []
    for name, _ in job.allocation():
        node = nodes.get(name)
        if node is None or node.last_report_unix is None:
            return []
        out.extend((name, g) for g in node.gpus if job.job_id in g.opportunistic_jobs)
    return out


def fits_quota(quota: Optional[int], have: int, gpus: int) -> bool:
    """job_submit.lua's and the coordinator's rule: a tenant's guaranteed GPUs plus this job's fit its
    quota (no quota: always)."""
    return quota is None or have + gpus <= quota


def _fifo(job: JobView) -> tuple:
    return (job.submit_unix, len(job.job_id), job.job_id)


def step(now: float, jobs: Collection[JobView], quotas: Mapping[str, int], params: PolicyParams,
         skip: Collection[str], nodes: Mapping[str, NodeView]) -> list[Decision]:
    used = usage_by_account(jobs)
    # A task of an elastic array across nodes stays what job_submit.lua made it (opportunistic: an auto
    # job resolved guaranteed there loses its elastic range): its tasks are one training, and one task
    # made guaranteed would still go down with the rest whenever the opportunistic host is preempted
    # (preemption.taken_down), a guaranteed job harmed.
    candidates = [
        j for j in jobs
        if j.job_id not in skip and not (j.elastic_group and not j.held_for_quota) and (
            (j.state == "PENDING" and (j.requested in WANTS_GUARANTEED or j.held_for_quota))
            or (params.upgrade_running and j.state == "RUNNING" and j.job_class == "opportunistic"
                and j.requested in WANTS_GUARANTEED))
    ]
    candidates.sort(key=_fifo)
    out: list[Decision] = []
    upgraded_gpus: set[tuple[str, int]] = set()  # a GPU takes at most one guaranteed job per cycle too
    for j in candidates:
        quota: Optional[int] = quotas.get(j.account, params.default_quota)
        have = used.get(j.account, 0)
        fits = fits_quota(quota, have, j.gpus)
        inputs = {"account": j.account, "quota": quota, "quota_used": have, "gpus": j.gpus,
                  "requested": j.requested, "job_class": j.job_class, "state": j.state,
                  "held_for_quota": j.held_for_quota, "submit_unix": j.submit_unix, "now": now}
        if j.state == "RUNNING":
            gpus = _reported_gpus(j, nodes) if fits else None
            if gpus and any((n, g.index) in upgraded_gpus for n, g in gpus):
                gpus = None  # another job on this GPU was just upgraded: it is no longer shared-free
            d = _upgrade(j, fits, quota, have, gpus, inputs)
            if isinstance(d, Upgrade):
                upgraded_gpus.update((n, g.index) for n, g in gpus or ())
        else:
            d = _pending(now, j, fits, quota, have, params, inputs)
        if d is not None:
            out.append(d)
        if fits and (j.state == "PENDING" and j.requested in WANTS_GUARANTEED or isinstance(d, Upgrade)):
            used[j.account] = have + j.gpus
    return out


def _quota_text(account: str, quota: Optional[int], have: int, gpus: int) -> str:
    return f"tenant {account}: {have} of {quota} guaranteed GPUs in use, this job needs {gpus}"


def _pending(now: float, j: JobView, fits: bool, quota: Optional[int], have: int, params: PolicyParams,
             inputs: dict) -> Optional[Decision]:
    held = j.held_for_quota
    if j.requested not in WANTS_GUARANTEED:
        return ReleaseHold(j.job_id, reason=f"the job asked for {j.requested}, which needs no quota",
                           inputs=inputs) if held else None
    # Formatted only for a decision: most pending jobs get none, and a cycle looks at thousands.
    def text() -> str:
        return "no quota configured" if quota is None else _quota_text(j.account, quota, have, j.gpus)

    if fits:
        if j.job_class != "guaranteed":
            return SetClass(j.job_id, "guaranteed", reason=f"within quota ({text()})", inputs=inputs,
                            release_hold=held)
        return ReleaseHold(j.job_id, reason=f"quota is free again ({text()})", inputs=inputs) if held else None
    if j.requested == "auto":
        if j.job_class != "opportunistic":
            return SetClass(j.job_id, "opportunistic", reason=f"auto over quota ({text()})", inputs=inputs,
                            release_hold=held)
        return ReleaseHold(j.job_id, reason="auto job runs opportunistic", inputs=inputs) if held else None
    if j.job_class == "opportunistic":
        # Already sent opportunistic after its wait: it is upgraded once it runs and quota frees.
        return ReleaseHold(j.job_id, reason="runs opportunistic meanwhile", inputs=inputs) if held else None
    waited = now - j.submit_unix
    q2o = params.queue_to_opportunistic_s
    if q2o is not None and waited >= q2o:
        return SetClass(j.job_id, "opportunistic",
                        reason=f"over quota ({text()}) and waited {waited:.0f} s >= {q2o:g} s: runs opportunistic meanwhile",
                        inputs={**inputs, "waited_s": waited}, release_hold=held)
    if held:
        return None
    return HoldForQuota(j.job_id, reason=f"guaranteed job would exceed its tenant's quota ({text()})", inputs=inputs)


def _upgrade(j: JobView, fits: bool, quota: Optional[int], have: int,
             gpus: Optional[list[tuple[str, GpuView]]], inputs: dict) -> Optional[Decision]:
    if not fits or not gpus:
        return None  # no quota, or the sidecars have not shown where it runs: cannot tell it shares nothing
    if any(g.guaranteed_jobs for _, g in gpus):
        return None
    text = "no quota configured" if quota is None else _quota_text(j.account, quota, have, j.gpus)
    return Upgrade(j.job_id, reason=f"tenant has quota again ({text}) and no guaranteed job shares its GPUs",
                   inputs={**inputs, "gpus_shared_with": [list(g.opportunistic_jobs) for _, g in gpus],
                           "gpu_indices": [g.index for _, g in gpus], "gpu_nodes": [n for n, _ in gpus]})
