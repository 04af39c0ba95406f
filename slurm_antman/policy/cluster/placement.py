"""Opportunistic room: which reporting nodes have a GPU that can take one more opportunistic job.

Slurm's count of the opportunistic GRES on a node stays the one slurm.conf gives it (antman.yaml's
slots per GPU times its GPUs): the core never lowers or raises it to follow the room. slurmctld checks
the count each slurmd registration reports against the count it found at the node's first one, and
while jobs hold that GRES any difference marks the node INVAL and drains it ("gres/antman_opp count
changed and jobs are using them"; src/interfaces/gres.c ``_node_config_validate``, 22.05 to 26.05).
slurmd registers again at every restart and, unasked, about every 20 pings (ping_nodes.c
``MAX_REG_FREQUENCY``: every 2,000 s at the default SlurmdTimeout of 300 s), so a count that followed
the room drained sharing nodes within the hour (seen on the devcluster under 22.05 and 24.11,
2026-11-29). Nodes without room are kept off pending opportunistic jobs instead (keep_off.py), and a
job Slurm starts where its GPUs turn out to have no room is requeued by its Prolog.

What the count was changed to by an earlier release is put back, on a node where no opportunistic
job holds a slot: there the next registration takes the count as found."""

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


def node_slots(node: NodeView, params: PolicyParams, slurm_in_use: int, busy_gpus: Collection[int]) -> tuple[int, dict]:
    """The opportunistic jobs ``node`` could hold now: slots Slurm has allocated plus the free slots of
    qualifying GPUs; 0 means no room. Jobs Slurm placed that the sidecar does not show yet take free
    slots first, so no slot is counted twice."""
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
    inputs = {"free_slots": free, "slurm_in_use": slurm_in_use, "reported_in_use": reported,
              "unseen": unseen, "gpus_qualifying": qualifying, "gpus_with_need": sorted(busy_gpus)}
    if node.unhealthy:
        inputs["unhealthy"] = node.unhealthy
    return slurm_in_use + max(0, free - unseen), inputs


def step(nodes: Collection[NodeView], jobs: Collection[JobView], params: PolicyParams,
         need_gpus: Mapping[str, set[int]]) -> tuple[list[SetOppSlots], list[str]]:
    """The counts to put back to slurm.conf's, and the nodes without room for one more opportunistic job."""
    in_use = opp_in_use_by_node(jobs)
    out: list[SetOppSlots] = []
    no_room: list[str] = []
    for n in nodes:
        held = in_use.get(n.name, 0)
        if n.opp_slots_in_slurm != n.opp_slots_configured and held == 0:
            out.append(SetOppSlots(n.name, n.opp_slots_configured, reason=(
                f"Slurm has {n.opp_slots_in_slurm} opportunistic slots, slurm.conf {n.opp_slots_configured}: put "
                "back while no job holds one, so that slurmd's next registration neither finds a changed count "
                "under running jobs (the node would be drained) nor leaves one in place"),
                inputs={"in_slurm": n.opp_slots_in_slurm, "configured": n.opp_slots_configured}))
        if n.last_report_unix is None:
            continue  # nothing measured: Slurm's own rules alone
        total, _ = node_slots(n, params, held, need_gpus.get(n.name, ()))
        if total <= held:  # not one free slot on a GPU that meets the rules
            no_room.append(n.name)
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
