"""Opportunistic capacity in Slurm: each reporting node's count-only GRES follows what its GPUs can take."""

from __future__ import annotations

from typing import Collection, Mapping

from .decisions import SetOppSlots
from .model import HOLDING_STATES, GpuView, JobView, NodeView, PolicyParams
from slurm_antman.policy.progress import predicted_progress


def gpu_qualifies(g: GpuView, params: PolicyParams) -> bool:
    """Room for one more opportunistic job: memory, AntMan's utilisation rule, at most one guaranteed
    job, and a predicted progress worth running for (policy.progress): otherwise the job waits. A GPU
    whose guaranteed job is too new to show in its utilisation has no room until it does."""
    spare = g.mem_total_bytes - g.mem_used_bytes
    return (g.util_measured and spare >= params.min_opp_mem_bytes + params.headroom_bytes
            and g.util < params.util_threshold
            and len(g.guaranteed_jobs) <= 1
            and predicted_progress(g.util, len(g.guaranteed_jobs), len(g.opportunistic_jobs),
                                   params.target_slowdown, params.slot_fill) >= params.min_progress)


def opp_in_use_by_node(jobs: Collection[JobView]) -> dict[str, int]:
    """Opportunistic GRES Slurm has allocated per node (one per GPU of each opportunistic job, on each
    of its nodes)."""
    used: dict[str, int] = {}
    for j in jobs:
        if j.job_class == "opportunistic" and j.state in HOLDING_STATES:
            for node, count in j.allocation():
                used[node] = used.get(node, 0) + count
    return used


MIN_SLOTS_PER_NODE = 1


def node_slots(node: NodeView, params: PolicyParams, slurm_in_use: int, busy_gpus: Collection[int]) -> tuple[int, dict]:
    """The GRES count for ``node``: slots Slurm has allocated plus the free slots of qualifying GPUs.

    Slurm subtracts its own allocations from the count, so the count must include them. Jobs Slurm
    placed that the sidecar does not show yet take free slots first, so nothing is handed out twice.
    """
    free = 0
    reported = 0
    qualifying = 0
    slots = params.slots_per_gpu
    need_mem = params.min_opp_mem_bytes + params.headroom_bytes
    threshold = params.util_threshold
    # The hot loop of a cycle (every GPU of the cluster): gpu_qualifies() inlined.
    target, floor, fill = params.target_slowdown, params.min_progress, params.slot_fill
    healthy = not node.unhealthy
    for g in node.gpus:
        n_opp = len(g.opportunistic_jobs)
        reported += n_opp
        if (healthy and g.util < threshold and g.util_measured and g.mem_total_bytes - g.mem_used_bytes >= need_mem
                and len(g.guaranteed_jobs) <= 1 and g.index not in busy_gpus
                and predicted_progress(g.util, len(g.guaranteed_jobs), n_opp, target, fill) >= floor):
            qualifying += 1
            if n_opp < slots:
                free += slots - n_opp
    unseen = max(0, slurm_in_use - reported)
    # Never 0: slurmctld 22.05 rejects at submission ("Requested node configuration is not
    # available") a GRES request that no node is configured to satisfy, instead of queueing it. So
    # a node without room still admits one opportunistic job, which the sidecar then shrinks or has
    # preempted; the alternative would be to lose submissions.
    total = max(MIN_SLOTS_PER_NODE, slurm_in_use + max(0, free - unseen))
    inputs = {"free_slots": free, "slurm_in_use": slurm_in_use, "reported_in_use": reported,
              "unseen": unseen, "gpus_qualifying": qualifying, "gpus_with_need": sorted(busy_gpus)}
    if node.unhealthy:
        inputs["unhealthy"] = node.unhealthy
    return total, inputs


def step(nodes: Collection[NodeView], jobs: Collection[JobView], params: PolicyParams,
         need_gpus: Mapping[str, set[int]]) -> tuple[list[SetOppSlots], list[str]]:
    """The count changes, and the nodes whose count is only the minimum slot (no room at all)."""
    in_use = opp_in_use_by_node(jobs)
    out: list[SetOppSlots] = []
    no_room: list[str] = []
    for n in nodes:
        if n.last_report_unix is None:
            continue  # nothing measured: slurmctld keeps the configured count
        total, inputs = node_slots(n, params, in_use.get(n.name, 0), need_gpus.get(n.name, ()))
        if inputs["slurm_in_use"] + max(0, inputs["free_slots"] - inputs["unseen"]) < MIN_SLOTS_PER_NODE:
            no_room.append(n.name)
        if total != n.opp_slots_in_slurm:
            inputs.update(in_slurm=n.opp_slots_in_slurm, report_unix=n.last_report_unix)
            out.append(SetOppSlots(n.name, total, reason=(
                (f"node unhealthy ({n.unhealthy}): no opportunistic job starts there; " if n.unhealthy else "")
                + f"{inputs['gpus_qualifying']} GPUs with room have {inputs['free_slots']} free slots, Slurm has "
                f"{inputs['slurm_in_use']} allocated: count {total}, Slurm has {n.opp_slots_in_slurm}"),
                inputs=inputs))
    return out, no_room


def no_room_apart(nodes: Collection[NodeView], jobs: Collection[JobView], params: PolicyParams,
                  need_gpus: Mapping[str, set[int]]) -> dict[str, frozenset[str]]:
    """For each elastic array across nodes with a pending task: the reporting nodes where fewer GPUs with
    room than the task's width are free of the array's other tasks. The node's sidecar never places two
    tasks of one array on one GPU (policy.node.placement, ``apart``), so its Prolog would requeue the
    task there. A task Slurm shows on a node whose report does not show it yet is taken to hold that
    many of the node's GPUs with room: better kept off a moment too long than refused."""
    width: dict[str, int] = {}
    for j in jobs:
        if j.elastic_group and j.state == "PENDING" and j.job_class == "opportunistic":
            width[j.elastic_group] = max(width.get(j.elastic_group, 0), j.gpus)
    if not width:
        return {}
    group_of: dict[str, str] = {}
    slurm_on: dict[str, dict[str, int]] = {}  # node -> task of an array with a pending task -> its GPUs there
    for j in jobs:
        if j.elastic_group in width and j.state in HOLDING_STATES:
            group_of[j.job_id] = j.elastic_group
            for name, count in j.allocation():
                slurm_on.setdefault(name, {})[j.job_id] = count
    out: dict[str, set[str]] = {}
    for n in nodes:
        if n.last_report_unix is None:
            continue
        taken: dict[str, set[int]] = {}  # group -> GPUs of this node one of its tasks is on
        unseen = dict(slurm_on.get(n.name, {}))
        for g in n.gpus:
            for job_id in (*g.opportunistic_jobs, *g.guaranteed_jobs):
                group = group_of.get(job_id)
                if group is not None:
                    taken.setdefault(group, set()).add(g.index)
                    unseen.pop(job_id, None)
        unseen_gpus: dict[str, int] = {}
        for job_id, count in unseen.items():
            unseen_gpus[group_of[job_id]] = unseen_gpus.get(group_of[job_id], 0) + count
        if not taken and not unseen_gpus:
            continue
        busy = need_gpus.get(n.name, ())
        with_room = [] if n.unhealthy else [
            g.index for g in n.gpus
            if g.index not in busy and len(g.opportunistic_jobs) < params.slots_per_gpu and gpu_qualifies(g, params)]
        for group in set(taken) | set(unseen_gpus):
            free = sum(1 for i in with_room if i not in taken.get(group, ()))
            if free - unseen_gpus.get(group, 0) < width[group]:
                out.setdefault(group, set()).add(n.name)
    return {group: frozenset(names) for group, names in out.items()}
