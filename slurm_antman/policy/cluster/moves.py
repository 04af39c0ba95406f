"""Moving a crawling opportunistic job to a GPU where it progresses (pure).

A sidecar reports the opportunistic jobs that crawl on its GPUs (``slurm_antman.policy.node.core``: under the
minimum progress beside a busy guaranteed job, or the slowest of opportunistic jobs whose sharing is
a loss) and since when. Once that has lasted ``move_after_s`` and another GPU of the cluster
promises at least ``move_gain`` times its progress (``progress.predicted_progress``), the job is moved:
a preemption notice (the job checkpoints), a requeue when the grace time is over (the preemption
module's path), and a placement memory of the GPU it crawled on, so it is not put back there. The
alternative, leaving it, is what made sharing a loss before: a job at a 5 % share beside a
guaranteed job that runs for days, while GPUs elsewhere free up.

The task of an elastic array that hosts its training's rendezvous (``JobView.elastic_host``) moves
with its whole array, as its preemption does (``preemption.taken_down``): its requeue alone would end
the rendezvous under the other tasks, which would hold their GPUs without training until it came back
(93 of 121 whole-job requeues of arrays on the Philly trace, in the simulator), and never moving it
leaves the whole training at the pace of a host crawling beside a guaranteed job (whole trace, duty
throttle: 30,984 s mean JCT against 22,591 s moving the array; docs/evaluation.md). Its other tasks move
as any job: a shrink, and a grow elsewhere after the hold.
"""

from __future__ import annotations

from typing import Mapping

from .decisions import Decision, PreemptNotice
from .model import Avoid, GpuView, JobView, NodeView, PolicyParams, Preemption
from slurm_antman.policy.progress import predicted_progress

from .preemption import taken_down


def _candidates(nodes: Mapping[str, NodeView], params: PolicyParams) -> list[tuple[float, str, GpuView]]:
    out = []
    need_mem = params.min_opp_mem_bytes + params.headroom_bytes
    for n in nodes.values():
        if n.last_report_unix is None:
            continue
        for g in n.gpus:
            if (len(g.opportunistic_jobs) >= params.slots_per_gpu or len(g.guaranteed_jobs) > 1
                    or g.mem_total_bytes - g.mem_used_bytes < need_mem):
                continue
            score = predicted_progress(g.util, len(g.guaranteed_jobs), len(g.opportunistic_jobs),
                                       params.target_slowdown, params.slot_fill)
            if score >= params.min_progress:  # no move goes to a GPU promising less (step's ``want``)
                out.append((score, n.name, g))
    out.sort(key=lambda c: (-c[0], c[1], c[2].index))
    return out


def best_target(node: NodeView, params: PolicyParams) -> float:
    """The most progress a GPU of ``node`` promises a moved job (the score ``step`` ranks targets by),
    -inf where none qualifies. ``step`` moves a crawler only to a GPU promising at least its ``want``,
    so a caller that knows every node's best can leave out of a snapshot the nodes no crawler could
    move to (the simulator's cycles, lab/evaluation/simulator/antman.py)."""
    found = _candidates({node.name: node}, params)
    return found[0][0] if found else float("-inf")


def move_floor(progress: float, params: PolicyParams) -> float:
    """The least a target must promise a crawler at ``progress`` (``step``'s ``want``)."""
    return max(params.min_progress, params.move_gain * progress)


def step(now: float, nodes: Mapping[str, NodeView], jobs: Mapping[str, JobView], params: PolicyParams,
         busy: set[str]) -> tuple[list[Decision], dict[str, Preemption], dict[str, Avoid]]:
    """Notices for the crawling jobs that should move, their preemption entries, and their placement
    memory. ``busy``: jobs already being preempted, requeued or decided about this cycle."""
    if params.move_after_s is None:
        return [], {}, {}
    decisions: list[Decision] = []
    preempting: dict[str, Preemption] = {}
    avoid: dict[str, Avoid] = {}
    targets = None
    taken: set[tuple[str, int]] = set()
    crawlers = sorted(((since, n.name, g, jid) for n in nodes.values() if n.last_report_unix is not None
                       for g in n.gpus for jid, since in g.crawling), key=lambda c: (c[0], c[1], c[2].index, c[3]))
    for since, node, gpu, jid in crawlers:
        job = jobs.get(jid)
        if (job is None or job.state != "RUNNING" or job.job_class != "opportunistic" or jid in busy
                or jid in preempting or now - since < params.move_after_s):
            continue
        now_progress = dict(gpu.progress).get(jid, 0.0)
        want = move_floor(now_progress, params)
        if targets is None:
            targets = _candidates(nodes, params)
        chosen = [(s, n, g) for s, n, g in targets
                  if s >= want and (n, g.index) not in taken and not (n == node and g.index == gpu.index)
                  and jid not in g.opportunistic_jobs][:job.gpus]
        if len(chosen) < job.gpus:
            continue
        taken.update((n, g.index) for _, n, g in chosen)
        where = ", ".join(f"{n} GPU {g.index} ({s:.2f})" for s, n, g in chosen)
        decisions.append(PreemptNotice(
            jid, node, params.grace_s,
            reason=(f"moved: progress {now_progress:.2f} of its solo rate on {node} GPU {gpu.index} for "
                    f"{now - since:.0f} s (minimum {params.min_progress:.2f}); {where} promises more"),
            inputs={"node": node, "gpu": gpu.index, "progress": now_progress, "crawling_since_unix": since,
                    "targets": [[n, g.index, round(s, 3)] for s, n, g in chosen], "move": True}))
        preempting[jid] = Preemption(jid, node, now, now + params.grace_s, job.restarts,
                                     f"move: progress {now_progress:.2f}", gpu.index, "")
        avoid[jid] = Avoid(jid, node, gpu.index, now)
        for t in taken_down(job, jobs)[1:]:  # the rest of an elastic array whose host moves
            if t.job_id in busy or t.job_id in preempting:
                continue
            decisions.append(PreemptNotice(
                t.job_id, t.node or node, params.grace_s,
                reason=f"task of elastic array {job.elastic_group}, whose rendezvous host {jid} is moved",
                inputs={"node": node, "gpu": gpu.index, "host": jid, "move": True}))
            preempting[t.job_id] = Preemption(t.job_id, t.node or node, now, now + params.grace_s, t.restarts,
                                              f"move of its array's host {jid}", -1, "")
    return decisions, preempting, avoid
