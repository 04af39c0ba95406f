"""Keeping pending opportunistic jobs off nodes without room (``opportunistic.no_room: wait``).

Every node keeps the opportunistic slots slurm.conf gives it whatever its GPUs look like (placement.py
says why the count never follows the room). Slurm would start a pending opportunistic job on a free
slot of a node where its sidecar finds no GPU that meets the rules, and its Prolog would requeue it
(docs/evaluation.md: started there anyway, the job crawls beside a busy guaranteed job). So the core
sets each pending opportunistic job's ``ExcNodeList`` to the nodes the user
excluded plus the nodes with no room, and narrows it again as nodes gain room. Slurm 22.05 accepts
the update on a pending job; a job excluded from every node stays pending (Reason=BadConstraints)
and starts once the list is narrowed (checked on the devcluster, 2026-11-24).

A pending task of an elastic array across nodes is also kept off the nodes where its array's other
tasks leave no GPU with room (``placement.no_room_apart``): the sidecar there would refuse it, as it
refuses any job it has no room for, and Slurm, which counts only slots, would start it there again.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Collection, Mapping

from .decisions import Decision, KeepOff, MakeEligible
from .model import JobView, KeptOff


def step(jobs: Collection[JobView], no_room: Collection[str], kept: Mapping[str, KeptOff],
         skip: Collection[str], apart: Mapping[str, Collection[str]] = MappingProxyType({}),
         unhealthy: Mapping[str, str] = MappingProxyType({}),
         ) -> tuple[list[Decision], dict[str, KeptOff]]:
    """One ``KeepOff`` per pending opportunistic job whose ExcNodeList differs from what it should be
    (its user's exclusions plus ``no_room``, plus ``apart[group]`` for a task of elastic array ``group``);
    the records of the jobs still alive.

    Jobs in ``skip`` (a requeue of the coordinator's own in progress) get their ``KeepOff`` too: the
    caller issues it before the ``MakeEligible`` that lets Slurm start them. A job that Slurm holds in
    its post-requeue BeginTime wait and that is already kept off every node without room (its Prolog
    refused it on one, in the moment before its list caught up) is made eligible: the wait would only
    delay it, the exclusions already keep it from crawling. ``unhealthy``: the sidecar's reason for each
    node without room that takes no opportunistic job at all (a full state directory, a failed device
    grant), named in the reason so that ``antman explain`` says why."""
    out: list[Decision] = []
    records: dict[str, KeptOff] = {}
    room_less = frozenset(no_room)
    for j in jobs:
        rec = kept.get(j.job_id)
        if j.job_class != "opportunistic":
            continue  # upgraded or reclassified: no longer the core's to keep off anywhere
        if j.state != "PENDING":
            if rec is not None:
                records[j.job_id] = rec  # a requeued job comes back with the list the core left
            continue
        current = frozenset(j.excluded_nodes)
        users = current.difference(rec.added if rec is not None else ())
        siblings = frozenset(apart.get(j.elastic_group, ())) - room_less - users if j.elastic_group else frozenset()
        want = tuple(sorted(users | room_less | siblings))
        added = tuple(sorted((room_less | siblings) - users))
        if added or rec is not None:
            records[j.job_id] = KeptOff(j.job_id, added)
        if want != tuple(sorted(current)):
            inputs = {"no_room": sorted(room_less - users), "user_excluded": sorted(users),
                      "excluded_before": sorted(current)}
            sick = {n: unhealthy[n] for n in sorted(room_less - users) if n in unhealthy}
            if sick:
                inputs["unhealthy"] = sick
            if siblings:
                inputs["apart"] = sorted(siblings)
            out.append(KeepOff(j.job_id, want, reason=_why(sorted(room_less - users), sorted(siblings),
                                                           j.elastic_group, sick), inputs=inputs))
        elif j.begin_wait and j.restarts > 0 and j.job_id not in skip:
            out.append(MakeEligible(j.job_id, reason=(
                # Slurm's own preemption (a guaranteed job taking the node back) requeues the same way as
                # a Prolog that found no room: the snapshot cannot tell the two apart, so neither is claimed.
                "requeued (Slurm preempted it, or its Prolog found no room) and now kept off every node "
                "without room: Slurm's BeginTime wait after a requeue would only delay it"),
                inputs={"restarts": j.restarts, "excluded": list(want)}))
    return out, records


def _names(nodes: list[str]) -> str:
    return ", ".join(nodes[:8]) + (", ..." if len(nodes) > 8 else "")


def _why(room_less: list[str], siblings: list[str], group: str, sick: Mapping[str, str] = MappingProxyType({})) -> str:
    if not room_less and not siblings:
        return "every node it may use has room again"
    parts = []
    if room_less:
        parts.append(f"kept off {len(room_less)} node(s) where no GPU meets the opportunistic rules "
                     f"({_names(room_less)}); Slurm, which counts only their slots, would start it there")
    parts += [f"{node} takes no opportunistic job: {why}" for node, why in list(sick.items())[:8]]
    if siblings:
        parts.append(f"kept off {len(siblings)} node(s) where every GPU with room already holds a task of elastic "
                     f"array {group} ({_names(siblings)}): two ranks of one training never share a GPU")
    return "; ".join(parts)
