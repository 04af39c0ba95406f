"""The node-local policy: from a snapshot of one node (GPUs, jobs, what their agents reported) to
per-job memory limits and compute shares, and preemption requests.

Pure: no I/O and no clock. The caller passes ``now`` and the previous :class:`PolicyState`, and gets
the next state back, so the sidecar and a trace simulator drive the same code.

The rules (AntMan's, with TGS-style rate control for compute):

* Guaranteed jobs are never limited: unlimited memory, share 1.0.
* Opportunistic jobs on a GPU split the memory the guaranteed job does not need:
  ``total - foreign - guaranteed demand - headroom``. The split is recomputed on every call, so a
  rise in guaranteed demand shrinks them at once.
* Their compute budget on a GPU is an AIMD loop on the guaranteed job's iteration time against its
  baseline (its solo time, measured while no opportunistic job shared its GPUs; until one is known,
  the best time seen): above the target slowdown the budget is cut multiplicatively, near the
  baseline it grows additively. The slowdown is the mean over the reports since the last change (an
  episode, NodePolicyParams.slowdown_window), not a median, which bursty interference passes under. A jump in guaranteed memory demand also cuts it at once, because
  the guaranteed job is entering a heavier phase and must not wait a report for its speed back.
  A guaranteed job that arrives beside opportunistic jobs has no solo time: its first reports are a
  probe, with them held at ``probe_share`` (``baseline.probe``), and the loop starts after it.
* If the opportunistic jobs on a GPU cannot all keep their minimum memory, the newest ones are
  asked to be preempted (last in, first out) until the rest fit.
* Opportunistic jobs alone on a GPU (no guaranteed job there) are not throttled against each other:
  there is nobody to protect, and jobs that leave the GPU idle much of the time interleave. Their
  progress (iteration time against their time alone on the GPU) is measured instead, and where
  sharing is a loss (their progress adds up to less than one job alone) the one making the least
  progress is *crawling*. Not the newest: progress comes from each job's own reports, which a job
  controls, so a job that reports itself slow must only ever get itself moved, never a neighbour.
* An opportunistic job progressing under ``min_progress`` of its solo rate is crawling too, and
  beside a guaranteed job under ``crawl_below`` (at the floor share beside a busy one, say): there its
  pace will not come back, since the guaranteed job is never the one to yield. The sidecar reports since when; the
  coordinator moves it (``slurm_antman.policy.cluster.moves``) once that has lasted ``move_after_s`` and a
  GPU elsewhere promises ``move_gain`` times its progress. ``crawl_below`` is the placement floor
  (``min_progress``) or ``1 / move_gain``, the larger (``crawl_threshold``): under ``1 / move_gain`` a
  free GPU would still give the job ``move_gain`` times its pace. With the floor alone (0.25) a job at
  half pace beside a guaranteed job was never moved: on the Philly window a 4-GPU job ran 55 hours at
  0.45-0.5 beside a guaranteed BERT while whole nodes were free, and the 2-4 GPU jobs ended 1.27x their
  JCT under ``exclusive`` (docs/evaluation.md, "moves for pace, and narrowed elastic jobs", 2026-11-26).
* If throttling is not enough either (the guaranteed job stays over its target while the budget is
  at its floor, ``min_share``, for ``slow_preempt_s``), the newest opportunistic job on that GPU is
  asked to be preempted, one per period: measured interference between two jobs can be so large
  (a neighbour at 5 % duty costing a CNN 8 %) that only leaving restores the guaranteed job.
* Pause before requeue (PipeSwitch's lesson, OSDI'20): where the job's agents can pause in place
  and ``pause_max_s`` is set, each of the two preemption rules above pauses the job instead (its
  state moves to host memory in milliseconds, its GPU memory is freed). A paused job resumes once
  its GPU would fit it again (its minimum memory beside the others) for ``resume_hold_s``; one
  paused for ``pause_max_s`` is asked to be preempted after all. A task of an elastic job array
  (``JobInfo.elastic_group``) is never paused: its training's other ranks would wait for it, where its
  requeue lets them train on at a narrower width. Shrink, throttle, pause, requeue:
  one ladder, each step with its reason.
* Elastic width (Amoeba's idea, 2019; docs/elastic.md): an elastic job above its narrowest width
  gives up the one GPU that is needed (a ``WidthChange``) instead of pausing or leaving, and a
  crawling elastic job sheds the GPU it shares with a guaranteed job. It grows back, one GPU at a
  time, onto a GPU of the set it was placed on that holds nobody else, at most once per
  ``elastic_hold_s`` (the hysteresis: a width must pay for its change before it changes again).
  At its narrowest it goes the usual way.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Collection, Mapping, Optional

from .pinning import pin_grants
from .baseline import decided_on, new_episode, probe, progress_of, track_report
from .model import (
    GiB, UNLIMITED, Decision, GpuInfo, GuaranteedTrack, JobInfo, JobLimits, MiB, NodePolicyParams, NodeSnapshot,
    PauseRecord, PolicyState, PreemptRequest, WidthChange,
)

# The types are re-exported: callers import them from here, as before the split.
__all__ = ["GiB", "UNLIMITED", "Decision", "GpuInfo", "GuaranteedTrack", "JobInfo", "JobLimits", "MiB",
           "NodePolicyParams", "NodeSnapshot", "PauseRecord", "PolicyState", "PreemptRequest", "WidthChange",
           "can_shed", "crawl_threshold", "crawling", "decide", "measured_alone", "progress_of"]


def crawling(progress: Mapping[str, float], order: Mapping[int, list[str]], guaranteed_on: set[int],
             prev: Mapping[str, float], now: float, p: NodePolicyParams,
             narrowed: Collection[str] = ()) -> dict[str, float]:
    """Which opportunistic jobs crawl, and since when (module doc): under ``min_progress`` (beside a
    guaranteed job, or ``narrowed``, an elastic job below its width, ``crawl_below``), or, on a
    GPU without a guaranteed job whose opportunistic jobs together make less progress than one of
    them alone, the one making the least (the newest on a tie). ``order``: each GPU's opportunistic
    jobs, oldest first."""
    out: dict[str, float] = {}
    for g, jobs in order.items():
        known = [progress[j] for j in jobs if j in progress]
        for j in jobs:
            if j in progress and progress[j] < (p.crawl_below if g in guaranteed_on or j in narrowed else p.min_progress):
                out[j] = prev.get(j, now)
        if g not in guaranteed_on and len(jobs) > 1 and len(known) == len(jobs) and sum(known) < 1.0:
            slowest = min(reversed(jobs), key=lambda j: progress[j])
            out[slowest] = prev.get(slowest, now)
    return out


def crawl_threshold(min_progress: float, move_gain: float) -> float:
    """The progress under which an opportunistic job crawls (module doc): the placement floor, or the
    pace a move to a free GPU would still multiply by ``move_gain``, the larger."""
    return max(min_progress, 1.0 / move_gain)


def _sheddable(job: JobInfo, guarded: set[int]) -> list[int]:
    """The GPUs a crawling elastic job may shed, those it shares with a guaranteed job, or none: only
    while a GPU without one is left to it. The slowest GPU sets a synchronous job's pace, so shedding
    one of several shared GPUs would leave it crawling at a smaller width; shared everywhere, it is
    left to the coordinator to move whole."""
    mine = [g for g in job.gpus if g in guarded]
    ok = bool(mine) and len(mine) < len(job.gpus) and len(job.gpus) - 1 >= (job.elastic_min or 0)
    return mine if ok else []


def can_shed(job: JobInfo, shed: Mapping[str, set[int]]) -> bool:
    """Whether an elastic job can give up one more GPU instead of pausing or leaving: it can change
    width now and stays at least at its narrowest width after this call's other sheds."""
    if job.elastic_min is None or not job.can_resize:
        return False
    return len(job.gpus) - len(shed.get(job.job_id, ())) - 1 >= job.elastic_min


_NO_TRACK = GuaranteedTrack()  # (immutable: one for every job seen first)


def _registered(j: JobInfo) -> tuple[float, str]:
    return j.registered_unix, j.job_id


def _quantize(n: int, q: int) -> int:
    return max(0, n // q * q)


def measured_alone(job: JobInfo, gpu: GpuInfo, p: NodePolicyParams) -> PolicyState:
    """The state after ``job`` (guaranteed, with its ``iteration_ms`` and ``busy_ms``) reported alone
    on ``gpu`` for a whole baseline window: its solo time is known and no probe is due. What the
    simulator's steady state and ``antman bench interleave`` start from."""
    state = PolicyState()
    for i in range(-p.baseline_window, 0):
        state = decide(NodeSnapshot((gpu,), (replace(job, iteration=i),)), state, p, float(i)).state
    return state


def decide(snap: NodeSnapshot, state: PolicyState, p: NodePolicyParams, now: float) -> Decision:
    jobs = {j.job_id: j for j in snap.jobs}
    gpus = {g.index: g for g in snap.gpus}
    # Each GPU's jobs, and its guaranteed and opportunistic ones apart, listed once for the whole call
    # (read only): this runs at every report of every node, and in the simulator's steady state.
    on_gpu: dict[int, list[JobInfo]] = {g: [] for g in gpus}
    guar_by_gpu: dict[int, list[JobInfo]] = {g: [] for g in gpus}
    opp_by_gpu: dict[int, list[JobInfo]] = {g: [] for g in gpus}
    for j in snap.jobs:
        split = guar_by_gpu if j.job_class == "guaranteed" else opp_by_gpu if j.job_class == "opportunistic" else None
        for g in j.gpus:
            if g in on_gpu:
                on_gpu[g].append(j)
                if split is not None:
                    split[g].append(j)

    # Guaranteed jobs: baselines, slowdowns, demand jumps.
    tracks: dict[str, GuaranteedTrack] = {}
    probing_gpus: set[int] = set()
    slowdown: dict[str, float] = {}
    rose: set[str] = set()
    for j in snap.jobs:
        if j.job_class != "guaranteed":
            continue
        alone = True
        for g in j.gpus:
            if opp_by_gpu.get(g):
                alone = False
                break
        prev = state.guaranteed.get(j.job_id)
        start, held = probe(j, prev or _NO_TRACK, not alone, now, p)
        t, s, r = track_report(j, start, prev is not None, alone or held, p)
        tracks[j.job_id] = t
        if t.probe_since is not None:
            probing_gpus.update(g for g in j.gpus if g in on_gpu)
        if s is not None:
            slowdown[j.job_id] = s
        if r:
            rose.add(j.job_id)

    # Opportunistic jobs: solo baselines (nothing else on their GPUs) and best times.
    opp_tracks: dict[str, GuaranteedTrack] = {}
    for j in snap.jobs:
        if j.job_class != "opportunistic":
            continue
        alone = True
        for g in j.gpus:
            if g in on_gpu and len(on_gpu[g]) != 1:
                alone = False
                break
        prev = state.opportunistic.get(j.job_id)
        opp_tracks[j.job_id] = track_report(j, prev or _NO_TRACK, prev is not None, alone, p)[0]

    # Compute budget per GPU for its opportunistic jobs.
    budget: dict[int, float] = {}
    over_since: dict[int, float] = {}
    worst_on: dict[int, tuple[float, str]] = {}
    for g in gpus:
        guar = guar_by_gpu[g]
        if not guar:
            budget[g] = 1.0
            continue
        opp_here = opp_by_gpu[g]
        before = b = state.gpu_budget.get(g, p.initial_share)
        measured = [(slowdown[j.job_id], j.job_id) for j in guar
                    if j.job_id in slowdown and decided_on(tracks[j.job_id], p)]
        spans = min(tracks[j.job_id].episode_ms for j in guar)
        # The raise waits until the episode has seen an iteration of every neighbour at its share.
        bursts = max([o.iteration_ms or 0.0 for o in opp_here]) if opp_here else 0.0
        if any(j.job_id in rose for j in guar):
            b *= p.share_backoff
        elif measured:
            worst = max(measured)[0]
            if worst > p.target_slowdown:
                b *= p.share_backoff
            elif worst <= p.target_slowdown / 2 and spans >= bursts:
                b += p.share_step
        budget[g] = min(1.0, max(p.min_share, b))
        if budget[g] != before or spans > p.episode_max_s * 1000.0:
            for j in guar:
                tracks[j.job_id] = new_episode(tracks[j.job_id])
        if measured:
            worst_on[g] = max(measured)
            if worst_on[g][0] > p.target_slowdown and budget[g] <= p.min_share and opp_here:
                over_since[g] = state.over_since.get(g, now)
        elif g in state.over_since and opp_here:
            over_since[g] = state.over_since[g]  # no new report: nothing learned either way

    guarded_gpus = {g for g in gpus if guar_by_gpu[g]}

    # Memory per GPU; preempt newest opportunistic jobs when the minimums do not fit.
    preempted = {k: v for k, v in state.preempted.items() if k in jobs}
    paused = {k: v for k, v in state.paused.items() if k in jobs and k not in preempted}
    new_preempt: list[PreemptRequest] = []
    new_pauses: list[PauseRecord] = []
    resumes: list[str] = []
    # Elastic jobs: the GPUs each sheds in this call; a job shedding one is no longer counted there.
    shed: dict[str, set[int]] = {}
    per_job_mem: dict[str, list[int]] = {}
    per_job_share: dict[str, list[float]] = {}
    opp_sorted: dict[int, list[JobInfo]] = {}  # each GPU's opportunistic jobs, oldest first
    for g, info in gpus.items():
        guar_demand = sum(j.mem_demand_bytes for j in guar_by_gpu[g])
        available = info.memory_total_bytes - info.foreign_bytes - guar_demand - p.headroom_bytes
        opp = opp_by_gpu[g]
        if len(opp) > 1:
            opp = sorted(opp, key=_registered)
        opp_sorted[g] = opp
        active = [j for j in opp if j.job_id not in preempted and j.job_id not in paused] if preempted or paused \
            else list(opp)

        def ask_to_leave(victim: JobInfo, reason: str) -> None:
            paused.pop(victim.job_id, None)
            req = PreemptRequest(victim.job_id, g, reason, now, now + p.grace_s)
            preempted[victim.job_id] = req
            new_preempt.append(req)

        def pause_or_leave(victim: JobInfo, reason: str) -> None:
            if can_shed(victim, shed):
                shed.setdefault(victim.job_id, set()).add(g)
                return
            if victim.can_pause and p.pause_max_s is not None and victim.elastic_group is None:
                rec = PauseRecord(victim.job_id, g, reason, now)
                paused[victim.job_id] = rec
                new_pauses.append(rec)
            else:
                ask_to_leave(victim, reason)

        # Paused jobs first: too long paused -> requeue; fitting again for resume_hold_s -> resume.
        for j in (opp if paused else ()):
            rec = paused.get(j.job_id)
            if rec is None or rec.gpu != g:
                continue
            if p.pause_max_s is not None and now - rec.since_unix >= p.pause_max_s:
                ask_to_leave(j, f"paused for {now - rec.since_unix:.0f} s, the most sidecar.pause_max_s allows "
                                f"({p.pause_max_s:g} s): {rec.reason}")
                continue
            if available >= (len(active) + 1) * p.min_opportunistic_bytes:
                since = rec.fits_since_unix if rec.fits_since_unix is not None else now
                if now - since >= p.resume_hold_s:
                    del paused[j.job_id]
                    resumes.append(j.job_id)
                    active.append(j)
                    active.sort(key=lambda x: (x.registered_unix, x.job_id))
                else:
                    paused[j.job_id] = replace(rec, fits_since_unix=since)
            elif rec.fits_since_unix is not None:
                paused[j.job_id] = replace(rec, fits_since_unix=None)

        # A job asked to leave is not counted: its memory returns when Slurm requeues it.
        while active and available < len(active) * p.min_opportunistic_bytes:
            victim = active.pop()
            pause_or_leave(victim, f"GPU {g}: guaranteed demand {guar_demand // MiB} MiB leaves "
                                 f"{max(available, 0) // MiB} MiB for {len(active) + 1} opportunistic job(s) "
                                 f"that need {p.min_opportunistic_bytes // MiB} MiB each")
        since = over_since.get(g)
        if active and since is not None and p.slow_preempt_s is not None and now - since >= p.slow_preempt_s:
            worst, who = worst_on.get(g, (float("nan"), "?"))
            pause_or_leave(active.pop(), f"GPU {g}: guaranteed job {who} runs {worst:.1%} slower than alone (target "
                                       f"{p.target_slowdown:.0%}) with opportunistic jobs at the minimum compute "
                                       f"share {p.min_share:.0%} for {now - since:.0f} s")
            over_since[g] = now  # the next one only if a whole period passes without relief
        if active:
            each = max(p.min_opportunistic_bytes, _quantize(available // len(active), p.quantum_bytes))
            # Nobody to protect: opportunistic jobs run unthrottled beside each other (module doc).
            share = max(p.min_share, budget[g] / len(active)) if g in guarded_gpus else 1.0
            if g in probing_gpus:
                share = p.probe_share
            for j in active:
                per_job_mem.setdefault(j.job_id, []).append(each)
                per_job_share.setdefault(j.job_id, []).append(share)

    limits: dict[str, JobLimits] = {}
    for j in snap.jobs:
        if j.job_class == "guaranteed":
            limits[j.job_id] = UNLIMITED
        elif j.job_id in preempted or j.job_id in paused:
            limits[j.job_id] = JobLimits(p.min_opportunistic_bytes, p.min_share)
        elif j.job_id in per_job_mem:
            limits[j.job_id] = JobLimits(min(per_job_mem[j.job_id]), min(per_job_share[j.job_id]))
        else:  # no known GPU: nothing to share it with
            limits[j.job_id] = UNLIMITED

    progress: dict[str, float] = {}
    for j in snap.jobs:
        # Held by a probe, a job's pace is the probe's, not what its GPU gives it: not measured then.
        if j.job_class == "opportunistic" and j.job_id not in preempted and j.job_id not in paused \
                and probing_gpus.isdisjoint(j.gpus):
            v = progress_of(opp_tracks[j.job_id], j.iteration_ms, limits[j.job_id].compute_share)
            if v is not None:
                progress[j.job_id] = v
    # An elastic job below its width trains at about that fraction of its pace at full width, however
    # well each of its GPUs does (its workers' iteration time stays that of one worker's batch): its
    # progress, as the crawl rule and the coordinator's moves see it, is scaled so. Narrowed for good
    # (nothing of its set free to grow back into) it crawls, and is moved to a node with room.
    paced = dict(progress)
    elastic = [j for j in snap.jobs if j.elastic_min is not None]
    narrowed = [j.job_id for j in elastic if j.job_id in paced and 0 < len(j.gpus) < len(j.elastic_gpus)]
    for jid in narrowed:
        paced[jid] *= len(jobs[jid].gpus) / len(jobs[jid].elastic_gpus)
    order = {g: [j.job_id for j in opp_sorted[g] if j.job_id not in preempted and j.job_id not in paused]
             for g in gpus}
    crawl = crawling(paced, order, guarded_gpus, state.crawling, now, p, narrowed)

    changes: list[WidthChange] = []
    width_changed: dict[str, float] = {}
    if elastic or state.width_changed:  # (most nodes run no elastic job: nothing to change or keep)
        changes, width_changed = _width_changes(elastic, jobs, shed, crawl, progress, preempted, paused,
                                                guarded_gpus, on_gpu, gpus, state.width_changed, budget, now, p)
    for c in changes:
        crawl.pop(c.job_id, None)  # it sheds what slowed it: nothing for the coordinator to move

    # (every field, built directly: dataclasses.replace costs several times the constructor, per call)
    new_state = PolicyState(guaranteed=tracks,
                            gpu_budget={g: b for g, b in budget.items() if g in guarded_gpus},
                            preempted=preempted, over_since=over_since, opportunistic=opp_tracks, crawling=crawl,
                            paused=paused, width_changed=width_changed)
    grants = pin_grants(snap.jobs, guarded_gpus, paused, p.pin_budget_bytes)
    if grants:
        limits = {j: replace(lim, pin_bytes=grants.get(j, 0)) for j, lim in limits.items()}
    return Decision(limits, tuple(new_preempt), new_state, slowdown, paced, tuple(new_pauses), tuple(resumes),
                    tuple(changes))


def _width_changes(elastic: list[JobInfo], jobs: Mapping[str, JobInfo], shed: Mapping[str, set[int]],
                   crawl: Mapping[str, float], progress: Mapping[str, float], preempted: Mapping[str, PreemptRequest],
                   paused: Mapping[str, PauseRecord], guarded: set[int], on_gpu: Mapping[int, list[JobInfo]],
                   gpus: Mapping[int, GpuInfo], prev: Mapping[str, float], budget: Mapping[int, float], now: float,
                   p: NodePolicyParams) -> tuple[list[WidthChange], dict[str, float]]:
    """The elastic jobs' width changes (module doc), one per job at most, and the new hold times."""
    changed = {k: v for k, v in prev.items() if k in jobs}
    out: list[WidthChange] = []
    taken: set[int] = set()  # GPUs a growing job takes in this call: one job each
    for j in elastic:
        if not j.can_resize or j.job_id in preempted or j.job_id in paused:
            continue
        held = now - changed.get(j.job_id, float("-inf")) >= p.elastic_hold_s
        lost = shed.get(j.job_id, set())
        reason = ""
        if lost:
            reason = (f"GPU(s) {', '.join(map(str, sorted(lost)))} needed by the guaranteed job there; "
                      f"width {len(j.gpus)} -> {len(j.gpus) - len(lost)} instead of a pause or requeue")
        elif (j.job_id in crawl and held and progress.get(j.job_id, 1.0) < p.crawl_below
              and (mine := _sheddable(j, guarded))):
            # Crawling beside a guaranteed job (its own GPUs' pace, not its width, is what is slow).
            worst = min(mine, key=lambda g: (budget.get(g, 1.0), g))
            lost = {worst}
            reason = (f"crawling: GPU {worst} is shared with a guaranteed job at compute share "
                      f"{budget.get(worst, 1.0):.0%}; width {len(j.gpus)} -> {len(j.gpus) - 1}")
        elif held and len(j.gpus) < len(j.elastic_gpus):
            # Grow into an idle GPU of its set: nobody else on it, and room for the job's footprint.
            for g in j.elastic_gpus:
                info = gpus.get(g)
                if g in j.gpus or g in taken or info is None or on_gpu.get(g):
                    continue
                if info.memory_total_bytes - info.foreign_bytes - p.headroom_bytes < max(
                        j.mem_demand_bytes, p.min_opportunistic_bytes):
                    continue
                taken.add(g)
                out.append(WidthChange(j.job_id, tuple(sorted((*j.gpus, g))),
                                       f"GPU {g} is idle; width {len(j.gpus)} -> {len(j.gpus) + 1} "
                                       f"(held {p.elastic_hold_s:g} s since the last change)", now))
                changed[j.job_id] = now
                break
            continue
        if lost:
            out.append(WidthChange(j.job_id, tuple(g for g in j.gpus if g not in lost), reason, now))
            changed[j.job_id] = now
    return out, changed
