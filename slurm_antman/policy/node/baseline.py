"""How fast a job runs against how fast it runs alone: the per-job tracks of the node policy
(:mod:`.core`). A guaranteed job's slowdown drives the opportunistic jobs' compute budget on its GPUs;
an opportunistic job's progress drives the crawl rule. Both are measured against a solo baseline,
taken from the job's own reports while nothing shared its GPUs, or during a probe that holds its
neighbours (``NodePolicyParams.probe_share``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from .model import GuaranteedTrack, JobInfo, NodePolicyParams


def progress_of(track: GuaranteedTrack, latest_ms: Optional[float], share: float) -> Optional[float]:
    """An opportunistic job's progress: its solo iteration time over its latest. Before it has run
    alone, the best time seen stands in, and the job cannot be credited with more than its compute
    share (its throttle keeps it idle the rest of the time)."""
    if not latest_ms or latest_ms <= 0:
        return None
    base = track.baseline_ms
    if base is None:
        return None
    value = min(1.0, base / latest_ms)
    return value if track.solo_ms is not None else min(value, share)



def track_report(job: JobInfo, prev: GuaranteedTrack, seen: bool, alone: bool,
                 p: NodePolicyParams) -> tuple[GuaranteedTrack, Optional[float], bool]:
    """New track, the episode's mean slowdown so far (None without a new report beside neighbours:
    ``decided_on`` says whether the loop may act on it) and whether demand jumped."""
    fresh = job.iteration is not None and job.iteration != prev.last_iteration and job.iteration_ms
    solo, best, slowdown, samples = prev.solo_ms, prev.best_ms, None, prev.solo_samples
    solo_busy, busy_samples = prev.solo_busy_ms, prev.solo_busy_samples
    reports, spent, alone_ms = prev.episode_reports, prev.episode_ms, prev.episode_solo_ms
    if fresh:
        ms = float(job.iteration_ms)
        busy = float(job.busy_ms) if job.busy_ms is not None and 0 <= job.busy_ms <= ms else None
        window = max(1, p.baseline_window)
        if alone:
            samples = (samples + (ms,))[-window:]
            solo = sorted(samples)[(len(samples) - 1) // 2]
            if busy is not None:
                busy_samples = (busy_samples + (busy,))[-window:]
                solo_busy = sorted(busy_samples)[(len(busy_samples) - 1) // 2]
            reports, spent, alone_ms = 0, 0.0, 0.0  # a new episode beside neighbours starts afresh
        base = solo if solo is not None else best
        if not alone and base:
            # A report covers the iterations since the last one (agents report every 0.05-0.5 s).
            n = job.iteration - prev.last_iteration if prev.last_iteration is not None else 1
            n = n if 0 < n < 1_000_000 else 1
            if busy is not None and solo_busy is not None and solo is not None:
                took = solo + (busy - solo_busy)  # the input stalls' noise drops out (GuaranteedTrack)
            else:
                took = ms
            reports, spent, alone_ms = reports + 1, spent + n * took, alone_ms + n * base
            slowdown = spent / alone_ms - 1.0
        best = ms if best is None else min(best, ms)
    rose = seen and job.mem_demand_bytes - prev.demand_bytes >= p.demand_rise_bytes
    if not fresh and job.mem_demand_bytes == prev.demand_bytes:
        return prev, slowdown, rose  # nothing new: the same track (most calls, for jobs between reports)
    # Every field, not dataclasses.replace: this runs for each job at each report, and replace costs
    # several times the constructor (tests/test_local_policy.py checks that no field is dropped).
    track = GuaranteedTrack(solo_ms=solo, best_ms=best,
                            last_iteration=job.iteration if fresh else prev.last_iteration,
                            demand_bytes=job.mem_demand_bytes, solo_samples=samples, episode_reports=reports,
                            episode_ms=spent, episode_solo_ms=alone_ms, solo_busy_ms=solo_busy,
                            solo_busy_samples=busy_samples, probe_since=prev.probe_since, probed=prev.probed)
    return track, slowdown, rose


def decided_on(track: GuaranteedTrack, p: NodePolicyParams) -> bool:
    """Whether the episode holds enough to act on: ``slowdown_window`` reports and ``decide_after_s``
    of the job's time (NodePolicyParams)."""
    return track.episode_reports >= max(1, p.slowdown_window) and track.episode_ms >= p.decide_after_s * 1000.0


def new_episode(track: GuaranteedTrack) -> GuaranteedTrack:
    """The track after its GPU's budget changed: what it measured was the old share's effect."""
    return replace(track, episode_reports=0, episode_ms=0.0, episode_solo_ms=0.0)


def probe(job: JobInfo, prev: GuaranteedTrack, beside: bool, now: float,
           p: NodePolicyParams) -> tuple[GuaranteedTrack, bool]:
    """A guaranteed job's baseline probe (NodePolicyParams.probe_share): the track with the probe
    begun or ended, and whether this call's report counts as solo (it was taken with the neighbours
    held: the probe runs, or ends in this call; the track's ``probe_since`` says which). It begins at
    the job's first report beside opportunistic jobs while it has fewer than ``baseline_window`` solo
    reports: not before, since a job loading its data may take minutes to iterate and computes
    nothing meanwhile. That first report was measured at its neighbours' old shares, so it is not
    solo; the next ones may still overlap a neighbour's last launches before its boundary, and the
    baseline's lower median drops up to half of the window's slowest."""
    if p.probe_max_s <= 0:
        return prev, False  # no probe: the best time seen stands in, as before it existed
    if prev.probe_since is not None:
        # This call's report was taken with the neighbours held, whether or not the probe goes on.
        if beside and len(prev.solo_samples) < p.baseline_window and now - prev.probe_since < p.probe_max_s:
            return prev, True
        return replace(prev, probe_since=None, probed=True), True
    fresh = job.iteration is not None and job.iteration != prev.last_iteration and bool(job.iteration_ms)
    if beside and fresh and not prev.probed and len(prev.solo_samples) < p.baseline_window:
        return replace(prev, probe_since=now), False
    return prev, False
