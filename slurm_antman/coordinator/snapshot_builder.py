"""Builds the policy core's Snapshot from what the coordinator can see: Slurm's jobs and nodes (the
truth about jobs) and the latest report of each node's sidecar (the truth about GPUs)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Iterable, Mapping, Optional

from slurm_antman.config import AntmanConfig
from slurm_antman.jobtag import ACROSS_NODES, elastic_kind
from slurm_antman.policy.cluster import GpuView, JobView, NodeView, PreemptNeed, Snapshot, quotas_from_config
from slurm_antman.slurm.models import HELD_BY_ADMIN, Job, Node
from slurm_antman.slurm.parsing import gres_count


def _unix(dt: Any) -> Optional[float]:
    return dt.timestamp() if dt is not None else None


def job_view(job: Job, cfg: AntmanConfig, checkpoints: Mapping[str, float]) -> JobView:
    tag = job.tag  # None for a damaged tag too: the class is then the parser's, the request unknown
    requested = tag.request if tag is not None else ("none" if job.antman_class == "none" else job.antman_class)
    per_node = gres_count(job.tres_per_node, (cfg.slurm.gpu_gres, cfg.slurm.opportunistic_gres))
    held = tag is not None and tag.hold == "quota" and job.state == "PENDING" and job.reason == HELD_BY_ADMIN
    job_id = str(job.job_id)
    return JobView(
        job_id=job_id, account=job.account, user=job.user, state=job.state, requested=requested,
        job_class=job.antman_class, gpus=per_node * max(1, len(job.nodes)),
        node=job.nodes[0] if job.nodes else None,
        submit_unix=_unix(job.submit_time) or 0.0,
        start_unix=_unix(job.start_time) if job.state != "PENDING" else None,
        restarts=job.restarts, last_checkpoint_unix=checkpoints.get(job_id), held_for_quota=held,
        excluded_nodes=tuple(job.excluded_nodes), begin_wait=job.state == "PENDING" and job.reason == "BeginTime",
        # Slurm gives every node of a job its per-node GRES (TresPerNode): the slots are on each of them.
        gpus_by_node=tuple((n, per_node) for n in job.nodes) if len(job.nodes) > 1 else (),
        elastic_group=str(job.array_job_id) if _elastic_across_nodes(job, per_node) else "")


def _elastic_across_nodes(job: Job, per_node: int) -> bool:
    """A task of an elastic job array whose range spans several tasks' GPUs (job_submit.lua let it through
    only as one training across the array's tasks, docs/elastic.md): what the Prolog reads too."""
    tag = job.tag
    return (tag is not None and bool(job.array_job_id) and job.array_task is not None
            and elastic_kind(tag.elastic, per_node) == ACROSS_NODES)


def _first_index(array_task: Optional[str]) -> Optional[int]:
    """The lowest index an array record stands for: "3" is task 3, "2-5%2" the pending rest from 2."""
    m = re.match(r"\d+", array_task or "")
    return int(m.group()) if m else None


def _mark_hosts(jobs: Iterable[Job], views: tuple[JobView, ...]) -> tuple[JobView, ...]:
    """Each elastic array's rendezvous host: its task of the lowest index still in Slurm (the launcher's
    task 0 is SLURM_ARRAY_TASK_MIN; a task that ended no longer holds anything)."""
    lowest: dict[str, int] = {}
    index: dict[str, Optional[int]] = {}
    for job, v in zip(jobs, views):
        i = index[v.job_id] = _first_index(job.array_task)
        if v.elastic_group and i is not None:
            lowest[v.elastic_group] = min(i, lowest.get(v.elastic_group, i))
    return tuple(replace(v, elastic_host=True) if v.elastic_group and index[v.job_id] == lowest.get(v.elastic_group)
                 else v for v in views)


def node_views(cfg: AntmanConfig, nodes: Iterable[Node], reports: Mapping[str, Any], slurm_class: Mapping[str, str],
               now: float) -> tuple[NodeView, ...]:
    in_slurm = {n.name: n.gres.get(cfg.slurm.opportunistic_gres, 0) for n in nodes}
    out = []
    for host, group in sorted(cfg.node_groups_by_host().items()):
        configured = group.gpus * cfg.opportunistic.slots_per_gpu
        rep = reports.get(host)
        # A report with no GPUs (a sidecar before its first telemetry sample) says nothing about room.
        if rep is None or now - rep.received_unix > cfg.coordinator.stale_report_s or not rep.gpus:
            out.append(NodeView(host, (), configured, in_slurm.get(host, configured), None))
            continue
        reported_class = {j.job_id: j.job_class for j in rep.jobs}
        progress = {j.job_id: j.progress for j in rep.jobs if j.progress is not None}
        crawling = {j.job_id: j.crawling_since_unix for j in rep.jobs if j.crawling_since_unix is not None}
        gpus = []
        for g in rep.gpus:
            # Slurm's tag wins over the sidecar's class: an upgrade is visible there first.
            classes = [(j, slurm_class.get(j, reported_class.get(j, "none"))) for j in g.jobs]
            opp = tuple(j for j, c in classes if c == "opportunistic")
            gpus.append(GpuView(g.index, g.mem_total_bytes, g.mem_used_bytes, g.util,
                                tuple(j for j, c in classes if c == "guaranteed"), opp,
                                tuple((j, progress[j]) for j in opp if j in progress),
                                tuple((j, crawling[j]) for j in opp if j in crawling), g.util_measured))
        out.append(NodeView(host, tuple(gpus), configured, in_slurm.get(host, configured), rep.received_unix,
                            rep.unhealthy))
    return tuple(out)


def build(cfg: AntmanConfig, jobs: Iterable[Job], nodes: Iterable[Node], reports: Mapping[str, Any],
          now: float, quotas: Optional[Mapping[str, int]] = None) -> Snapshot:
    """``reports``: node -> the latest hub NodeReport of that node; ``quotas``: account -> GPUs, from
    the tenant quota source in force (antman.yaml's tenants when not given)."""
    fresh = {n: r for n, r in reports.items() if now - r.received_unix <= cfg.coordinator.stale_report_s}
    checkpoints: dict[str, float] = {}
    for rep in fresh.values():
        for j in rep.jobs:
            if j.last_checkpoint_unix is not None:
                checkpoints[j.job_id] = max(checkpoints.get(j.job_id, 0.0), j.last_checkpoint_unix)
    active = [j for j in jobs if not j.finished]
    views = _mark_hosts(active, tuple(job_view(j, cfg, checkpoints) for j in active))
    slurm_class = {v.job_id: v.job_class for v in views}
    needs = tuple(_needs(fresh, slurm_class))
    return Snapshot(now=now, jobs=views, nodes=node_views(cfg, nodes, reports, slurm_class, now),
                    quotas=quotas if quotas is not None else quotas_from_config(cfg), needs=needs)


def _needs(fresh: Mapping[str, Any], slurm_class: Mapping[str, str]) -> Iterable[PreemptNeed]:
    """A sidecar names the opportunistic job it would let go; the policy core wants the guaranteed
    job that needs the room (it picks the victim itself, by lost work). A request on a GPU with no
    guaranteed job is the sidecar's own business (e.g. two opportunistic jobs over memory) and is
    not turned into a preemption here."""
    for node, rep in sorted(fresh.items()):
        on_gpu = {g.index: g.jobs for g in rep.gpus}
        for r in rep.preempt_requests:
            owners = [j for j in on_gpu.get(r.gpu, ()) if slurm_class.get(j) == "guaranteed"]
            if owners:
                yield PreemptNeed(node, r.gpu, owners[0], r.reason, r.since_unix,
                                  r.job_id if getattr(r, "noncompliant", False) else "")
