"""The policy core: one pure function from a snapshot and the remembered state to decisions.

Order inside a cycle: preemption first (a guaranteed job is waiting), then moves of crawling
opportunistic jobs, then quotas (classes, holds,
upgrades), then placement (which nodes pending opportunistic jobs are kept off, and a GRES count an
earlier release changed put back). A job gets at most one decision per cycle, except that keeping it off nodes is its own, and
so is a checkpoint asked of a task of an elastic array when a sibling leaves or joins.

Decisions that follow from the snapshot alone (classes, holds, upgrades, slot counts put back) would repeat
every cycle until Slurm shows them done; ``state.issued`` suppresses such a repeat for
``params.reissue_after_s``, so the same snapshot and state twice give no duplicate. If executing one
fails, the daemon calls ``state.forget(decision)`` to retry it on the next cycle.
"""

from __future__ import annotations

from types import MappingProxyType

from . import array_checkpoint, keep_off, moves, placement, preemption, quota
from .decisions import Decision
from .model import Avoid, CoordinatorState, Issued, PolicyParams, Snapshot


def decide(snap: Snapshot, state: CoordinatorState, params: PolicyParams) -> tuple[list[Decision], CoordinatorState]:
    decisions, new_state, _ = decide_with_room(snap, state, params)
    return decisions, new_state


def decide_with_room(snap: Snapshot, state: CoordinatorState,
                     params: PolicyParams) -> tuple[list[Decision], CoordinatorState, list[str]]:
    """``decide``, and the snapshot's nodes without room for one more opportunistic job (the simulator
    keeps its Slurm's opportunistic jobs off them, as the daemon's KeepOff decisions do)."""
    now = snap.now
    jobs = {j.job_id: j for j in snap.jobs}
    nodes = {n.name: n for n in snap.nodes}

    pre = preemption.step(now, snap.needs, state, params, jobs, nodes)
    moved, moving, avoid = moves.step(now, nodes, jobs, params, pre.touched | pre.preempting.keys() | pre.requeued.keys())
    # A job preempted for a guaranteed job's need is not put back on that GPU either.
    for d in pre.decisions:
        if d.kind == "preempt_notice":
            avoid[d.job_id] = Avoid(d.job_id, d.node, int(d.inputs.get("gpu", -1)), now)
    pre.decisions.extend(moved)
    pre.preempting.update(moving)
    pre.touched.update(moving)
    # Placement memory lasts while the job does (it is a preference at placement, never a ban).
    avoid = {**{k: v for k, v in state.avoid.items() if k in jobs and k not in avoid}, **avoid}

    skip = pre.touched | pre.preempting.keys() | pre.requeued.keys()
    pre.decisions.extend(array_checkpoint.for_leaving(pre.decisions, jobs))
    derived: list[Decision] = quota.step(now, jobs.values(), snap.quotas, params, skip, nodes)
    derived.extend(array_checkpoint.for_joining(now, jobs, skip))

    need_gpus: dict[str, set[int]] = {}
    for need in snap.needs:
        need_gpus.setdefault(need.node, set()).add(need.gpu)
    slots, no_room = placement.step(snap.nodes, jobs.values(), params, need_gpus)
    derived.extend(slots)
    kept_off = dict(state.kept_off)
    first: list[Decision] = []
    if params.keep_off_no_room:
        apart = placement.no_room_apart(snap.nodes, jobs.values(), params, need_gpus)
        unhealthy = {n.name: n.unhealthy for n in snap.nodes if n.unhealthy and n.name in no_room}
        kept, kept_off = keep_off.step(jobs.values(), no_room, state.kept_off, skip, apart, unhealthy)
        first = [d for d in kept if d.kind == "keep_off"]
        derived.extend(d for d in kept if d.kind != "keep_off")

    # Exclusions go first: a requeued job made eligible in this cycle must not start where it has no room.
    issued: dict[str, Issued] = {}
    decisions = _unrepeated(first, state, params, now, issued) + list(pre.decisions)
    decisions += _unrepeated(derived, state, params, now, issued)

    new_state = CoordinatorState(
        preempting=MappingProxyType(pre.preempting),
        requeued=MappingProxyType(pre.requeued),
        issued=MappingProxyType(issued),
        avoid=MappingProxyType(avoid),
        kept_off=MappingProxyType(kept_off),
    )
    return decisions, new_state, no_room


def _unrepeated(derived: list[Decision], state: CoordinatorState, params: PolicyParams, now: float,
                issued: dict[str, Issued]) -> list[Decision]:
    """``derived`` without what was issued with the same signature less than ``reissue_after_s`` ago;
    records what is issued (or still suppressed) in ``issued``."""
    out: list[Decision] = []
    for d in derived:
        prev = state.issued.get(d.key)
        sig = d.signature
        if prev is not None and prev.signature == sig and now - prev.at_unix < params.reissue_after_s:
            issued[d.key] = prev
            continue
        issued[d.key] = Issued(sig, now)
        out.append(d)
    return out
