"""Choosing physical GPUs for an opportunistic job (pure). Slurm has already allocated the job a
count of opportunistic slots on this node; which GPU backs each slot is decided here, from
telemetry, by AntMan's rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Optional

from slurm_antman.policy.progress import predicted_progress


@dataclass(frozen=True)
class GpuLoad:
    index: int
    memory_total_bytes: int
    memory_used_bytes: int
    utilization_avg: float     # 0..1 over the configured window
    guaranteed_jobs: int
    opportunistic_jobs: int
    # False while a guaranteed job on the GPU is still starting: the window average then shows the
    # idle time before its first iteration, not the job, and would let opportunistic work in beside a
    # job that is about to keep the GPU busy.
    util_measured: bool = True

    @property
    def spare_bytes(self) -> int:
        return max(0, self.memory_total_bytes - self.memory_used_bytes)


@dataclass(frozen=True)
class Placement:
    gpus: list[int]
    placement: str   # fit | fallback | wait
    note: str


def util_measured(now: float, window_s: float, agent_grace_s: float, since_unix: float,
                  first_report_unix: Optional[float]) -> bool:
    """Whether a GPU's utilisation window shows a guaranteed job on it: once the window holds nothing
    from before the job's first iteration (its agent's first report). A job whose agent never reports
    (opted out, or broken) is taken as measured once the agent would have had to register
    (``sidecar.compliance_grace_s``) plus a window. ``since_unix``: when the sidecar began to watch
    the job (its registration, or the sidecar's own start after a restart, which empties the window)."""
    if first_report_unix is not None:
        return now - max(first_report_unix, since_unix) >= window_s
    return now - since_unix >= agent_grace_s + window_s


def _progress(g: GpuLoad, target_slowdown: float, fill: float = 0.0) -> float:
    return predicted_progress(g.utilization_avg, g.guaranteed_jobs, g.opportunistic_jobs, target_slowdown, fill)


def exclusion(g: GpuLoad, slots_per_gpu: int, threshold: float, window_s: float, target_slowdown: float,
              min_progress: float, avoid: Collection[int] = (), fill: float = 0.0,
              apart: Collection[int] = ()) -> tuple[str, str]:
    """The first opportunistic rule that keeps ``g`` from a new opportunistic job, as (rule, why):
    rule is one of ``apart``, ``avoid``, ``slots``, ``guaranteed``, ``unmeasured``, ``utilisation``,
    ``progress``; ("", "") when the GPU qualifies."""
    if g.index in apart:
        return "apart", f"GPU {g.index}: another task of the job's elastic array runs there"
    if g.index in avoid:
        return "avoid", f"GPU {g.index}: the job was moved off it for crawling"
    if g.opportunistic_jobs >= slots_per_gpu:
        return "slots", f"GPU {g.index}: {g.opportunistic_jobs}/{slots_per_gpu} opportunistic slots taken"
    if g.guaranteed_jobs > 1:
        return "guaranteed", f"GPU {g.index}: {g.guaranteed_jobs} guaranteed jobs (at most 1 may take opportunistic work)"
    if not g.util_measured:
        return "unmeasured", (f"GPU {g.index}: its guaranteed job has not iterated for a {window_s:g} s window yet; "
                              "its utilisation is not measured")
    if g.utilization_avg > threshold:
        return "utilisation", f"GPU {g.index}: utilisation {g.utilization_avg:.2f} > {threshold:.2f} over {window_s:g} s"
    if min_progress > 0 and _progress(g, target_slowdown, fill) < min_progress:
        return "progress", (f"GPU {g.index}: predicted progress {_progress(g, target_slowdown, fill):.2f} < {min_progress:.2f} "
                            f"({g.guaranteed_jobs} guaranteed, {g.opportunistic_jobs} opportunistic, utilisation "
                            f"{g.utilization_avg:.2f})")
    return "", ""


def _why_not(g: GpuLoad, slots_per_gpu: int, threshold: float, window_s: float, target_slowdown: float,
             min_progress: float, avoid: Collection[int], fill: float = 0.0, apart: Collection[int] = ()) -> str:
    return exclusion(g, slots_per_gpu, threshold, window_s, target_slowdown, min_progress, avoid, fill, apart)[1]


def choose_gpus(gpus: list[GpuLoad], count: int, slots_per_gpu: int, threshold: float,
                window_s: float, target_slowdown: float = 0.02, min_progress: float = 0.0,
                avoid: Collection[int] = (), wait_without_room: bool = False, fill: float = 0.0,
                apart: Collection[int] = ()) -> Placement:
    """``count`` distinct GPUs; never fewer than ``min(count, len(gpus))``: the job is already
    allocated, so when too few GPUs qualify the least-loaded are taken and the note says why.
    The best first: the most progress predicted (``policy.progress``), then the most spare memory.
    ``avoid``: GPUs the job was moved off (placement memory), taken only when nothing else is left.

    ``wait_without_room``: when fewer than ``count`` GPUs qualify, only those are returned, as
    placement ``wait``: the job should wait for room rather than start crawling beside a busy
    guaranteed job (what the least-loaded fallback gives on a busy cluster; docs/evaluation.md).

    ``apart``: GPUs where another task of the job's elastic array across nodes runs or is placed
    (docs/elastic.md). Two ranks of one training on one GPU make every step of the whole training wait
    for the slower pair, so such a GPU is no room for the job, before any other rule, and a task of
    several GPUs needs every one of them free of its siblings. Too few: ``wait`` as above; without
    ``wait_without_room`` (no_room: fallback, a client that cannot requeue) the fallback takes GPUs
    free of siblings first, whatever else keeps them, and a sibling's GPU only when none is left."""
    if not gpus:
        raise ValueError("this node has no GPUs to place an opportunistic job on")
    reasons = {g.index: _why_not(g, slots_per_gpu, threshold, window_s, target_slowdown, min_progress, avoid, fill,
                                 apart) for g in gpus}
    # Ties go to the highest index: Slurm hands out the physical gpu GRES lowest index first, so a
    # guaranteed job whose Prolog has not registered yet most likely sits on a low one.
    fit = sorted((g for g in gpus if not reasons[g.index]),
                 key=lambda g: (-_progress(g, target_slowdown, fill), -g.spare_bytes,
                                g.guaranteed_jobs + g.opportunistic_jobs, g.utilization_avg, -g.index))
    if len(fit) >= count:
        kept_off = sorted(i for i in avoid if i in reasons)
        note = (f"placement memory: kept off GPU(s) {', '.join(map(str, kept_off))}, where the job was "
                "moved or preempted from" if kept_off else "")
        return Placement([g.index for g in fit[:count]], "fit", note)
    if wait_without_room:
        # Placement memory is a preference, never a ban: a GPU the job was moved off that otherwise
        # qualifies is taken before the job is made to wait (on a one-GPU node it is the only choice).
        if avoid:
            plain = {g.index: _why_not(g, slots_per_gpu, threshold, window_s, target_slowdown, min_progress, (), fill,
                                       apart) for g in gpus if g.index in avoid}
            back = sorted((g for g in gpus if g.index in plain and not plain[g.index]),
                          key=lambda g: (-_progress(g, target_slowdown, fill), -g.spare_bytes, -g.index))
            if len(fit) + len(back) >= count:
                taken = fit + back[: count - len(fit)]
                return Placement([g.index for g in taken], "fit",
                                 "placement memory: no other GPU met the opportunistic rules, so GPU(s) "
                                 f"{', '.join(str(g.index) for g in back[: count - len(fit)])}, where the job "
                                 "was moved or preempted from, were taken again")
        return Placement([g.index for g in fit], "wait",
                         f"{len(fit)} of {count} GPU(s) met the opportunistic rules; the job waits for room: "
                         + "; ".join(r for r in reasons.values() if r))
    rest = sorted((g for g in gpus if reasons[g.index]),
                  key=lambda g: (g.index in apart, g.index in avoid, g.opportunistic_jobs + g.guaranteed_jobs,
                                 g.utilization_avg, -g.spare_bytes, g.index))
    chosen = fit + rest[: count - len(fit)]
    note = (f"{len(fit)} of {count} GPU(s) met the opportunistic rules; chose the least-loaded: "
            + "; ".join(reasons[g.index] for g in rest[: count - len(fit)]))
    if count > len(gpus):
        note += f"; the job asked for {count} GPUs but the node has {len(gpus)}"
    return Placement([g.index for g in chosen], "fallback", note)
