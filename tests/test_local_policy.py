"""The pure local policy and GPU placement on hand-built snapshots."""

from __future__ import annotations

import pytest

from slurm_antman.policy.node.core import (
    GiB, MiB, GpuInfo, JobInfo, NodePolicyParams, PolicyState, NodeSnapshot, UNLIMITED, decide,
)
from slurm_antman.policy.node.placement import GpuLoad, choose_gpus

P = NodePolicyParams()
GPU0 = GpuInfo(0, 80 * GiB)


def guar(demand_gib: float = 10, iteration=None, ms=None, gpus=(0,)) -> JobInfo:
    return JobInfo("100", "guaranteed", gpus, 1.0, int(demand_gib * GiB), iteration, ms)


def opp(job_id: str, t: float, gpus=(0,)) -> JobInfo:
    return JobInfo(job_id, "opportunistic", gpus, t, 2 * GiB, None, None)


def run(jobs, state=None, gpus=(GPU0,), now=1000.0, params=P):
    return decide(NodeSnapshot(tuple(gpus), tuple(jobs)), state or PolicyState(), params, now)


def solo(ms: float = 100.0, demand_gib: float = 10, params=P, now=1000.0):
    """The guaranteed job's first ``baseline_window`` reports, alone: its solo baseline is ``ms`` and no
    probe is due when a neighbour comes (iterations -9..-1, so a test's own numbering stays fresh)."""
    d = None
    for i in range(-params.baseline_window, 0):
        d = run([guar(demand_gib, i, ms)], d.state if d else None, now=now, params=params)
    return d


def test_guaranteed_unlimited_opportunistic_gets_the_rest():
    d = run([guar(10), opp("201", 2.0)])
    assert d.limits["100"] == UNLIMITED
    lim = d.limits["201"]
    assert lim.mem_limit_bytes == 80 * GiB - 10 * GiB - P.headroom_bytes
    assert lim.compute_share == P.initial_share
    assert not d.new_preemptions


def test_memory_split_between_opportunistic_jobs_and_foreign_use():
    gpu = GpuInfo(0, 80 * GiB, foreign_bytes=4 * GiB)
    d = run([guar(10), opp("201", 2.0), opp("202", 3.0)], gpus=(gpu,))
    each = (80 - 4 - 10) * GiB - P.headroom_bytes
    assert d.limits["201"].mem_limit_bytes == d.limits["202"].mem_limit_bytes == (each // 2) // (64 * MiB) * 64 * MiB
    assert d.limits["201"].compute_share == pytest.approx(P.initial_share / 2)


def test_guaranteed_demand_rise_shrinks_and_throttles_at_once():
    d1 = run([guar(10, 1, 100.0), opp("201", 2.0)], solo().state)
    d2 = run([guar(50, 1, 100.0), opp("201", 2.0)], d1.state)  # no new report, only memory grew
    assert d2.limits["201"].mem_limit_bytes == 80 * GiB - 50 * GiB - P.headroom_bytes
    assert d2.limits["201"].mem_limit_bytes < d1.limits["201"].mem_limit_bytes
    assert d2.limits["201"].compute_share == pytest.approx(d1.limits["201"].compute_share * P.share_backoff)


def beside(d, times_ms, per=10, opp_ms=None):
    """Reports beside opportunistic job 201, one per entry of ``times_ms``, each covering the ``per``
    mini-batches since the last (1 s of 100 ms ones: the episode reaches decide_after_s in its second
    report); returns every decision."""
    out = []
    for ms in times_ms:
        o = JobInfo("201", "opportunistic", (0,), 2.0, 2 * GiB, None, opp_ms)
        d = run([guar(10, d.state.guaranteed["100"].last_iteration + per, ms), o], d.state)
        out.append(d)
    return out


def test_the_loop_decides_once_per_episode_on_its_mean():
    d = solo()
    assert d.state.guaranteed["100"].solo_ms == 100.0
    # At baseline speed: nothing until the episode holds slowdown_window reports, then one raise.
    ds = beside(d, [100.5] * P.slowdown_window)
    assert [x.limits["201"].compute_share for x in ds[:-1]] == [P.initial_share] * (P.slowdown_window - 1)
    s1 = ds[-1].limits["201"].compute_share
    assert s1 == pytest.approx(P.initial_share + P.share_step)
    assert ds[-1].state.guaranteed["100"].episode_reports == 0  # the change starts a new episode
    # The same report again (no new iteration) counts nothing.
    again = run([guar(10, ds[-1].state.guaranteed["100"].last_iteration, 100.5), opp("201", 2.0)], ds[-1].state)
    assert again.state.guaranteed["100"].episode_reports == 0
    # One burst among clean reports: a median reads no slowdown, the mean reads 4 %, and cuts.
    ds = beside(ds[-1], [100.0, 120.0, 100.0, 100.0, 100.0])
    assert ds[-1].slowdown["100"] == pytest.approx(0.04)
    assert ds[-1].limits["201"].compute_share == pytest.approx(s1 * P.share_backoff)
    # Between target/2 and target: hold, and the episode goes on gathering.
    s2 = ds[-1].limits["201"].compute_share
    ds = beside(ds[-1], [101.5] * (P.slowdown_window + 3))
    assert ds[-1].slowdown["100"] == pytest.approx(0.015)
    assert all(x.limits["201"].compute_share == pytest.approx(s2) for x in ds)
    assert ds[-1].state.guaranteed["100"].episode_reports == P.slowdown_window + 3
    # The baseline did not move while sharing.
    assert ds[-1].state.guaranteed["100"].solo_ms == 100.0


def test_a_report_weighs_the_mini_batches_it_covers():
    d = solo()
    # Four reports of 10 clean mini-batches, one of a single mini-batch at 3x: 1/41 of the time is
    # slowed, not 1/5.
    ds = [run([guar(10, 9, 100.0), opp("201", 2.0)], d.state)]  # the solo window ended at iteration -1
    for it, ms in ((19, 100.0), (29, 100.0), (39, 100.0), (40, 300.0)):
        ds.append(run([guar(10, it, ms), opp("201", 2.0)], ds[-1].state))
    assert ds[-1].slowdown["100"] == pytest.approx((40 * 100 + 300) / (41 * 100) - 1)


def test_a_raise_waits_until_the_episode_spans_every_neighbour_iteration():
    """An opportunistic job whose iteration at its share takes 8 s may burst once in 8 s: an episode
    shorter than that may have seen none of it."""
    ds = beside(solo(), [100.0] * 9, opp_ms=8000.0)
    assert all(x.limits["201"].compute_share == P.initial_share for x in ds[:7])
    assert ds[7].limits["201"].compute_share == pytest.approx(P.initial_share + P.share_step)
    # A cut never waits for it.
    ds = beside(solo(), [100.0, 110.0, 110.0, 110.0, 110.0], opp_ms=8000.0)
    assert ds[-1].limits["201"].compute_share == pytest.approx(P.initial_share * P.share_backoff)


def test_an_episode_that_holds_for_long_starts_afresh():
    ds = beside(solo(), [101.5] * 40)
    assert all(x.limits["201"].compute_share == P.initial_share for x in ds)
    assert max(x.state.guaranteed["100"].episode_ms for x in ds) <= (P.episode_max_s + 1) * 1000.0


def test_warm_up_and_checkpoint_reports_do_not_inflate_the_solo_baseline():
    # The H100 proof's case: the first report holds the warm-up iteration (2.1 s), then 72 ms steps.
    d = run([guar(10, 0, 2100.0)])
    for i in range(1, P.baseline_window):
        d = run([guar(10, i, 72.0 + (i % 2))], d.state)
    assert d.state.guaranteed["100"].solo_ms == pytest.approx(72.0, abs=1.0)
    # A checkpoint save in a solo report moves it by nothing either.
    d = run([guar(10, 6, 5000.0)], d.state)
    assert d.state.guaranteed["100"].solo_ms == pytest.approx(72.0, abs=1.0)
    # So an opportunistic neighbour's 40 % is read as 40 %, and the share goes down, not up.
    for k in range(P.slowdown_window):
        d = run([guar(10, 100 + 30 * k, 101.0), opp("201", 2.0)], d.state)
    assert d.slowdown["100"] == pytest.approx(101.0 / 72.0 - 1.0, abs=0.02)
    assert d.limits["201"].compute_share < P.initial_share


def test_solo_baseline_follows_a_lasting_change_of_the_job_own_speed():
    d = run([guar(10, 0, 100.0)])
    for i in range(1, 12):
        d = run([guar(10, i, 100.0 if i < 4 else 150.0)], d.state)
    assert d.state.guaranteed["100"].solo_ms == 150.0  # a new phase, not noise: the median moves


def test_share_never_below_minimum_nor_above_one():
    d = beside(solo(), [200.0] * 40)[-1]
    assert d.limits["201"].compute_share == pytest.approx(P.min_share)
    d = beside(d, [100.0] * 200)[-1]
    assert d.limits["201"].compute_share == pytest.approx(1.0)


def test_without_solo_baseline_or_probe_best_seen_is_used():
    params = NodePolicyParams(probe_max_s=0)
    d = run([guar(10, 1, 120.0), opp("201", 2.0)], params=params)
    assert d.state.guaranteed["100"].baseline_ms == 120.0
    assert d.limits["201"].compute_share == params.initial_share
    d = run([guar(10, 2, 130.0), opp("201", 2.0)], d.state, params=params)
    assert d.slowdown["100"] == pytest.approx(130 / 120 - 1)


def test_preempt_newest_when_shrinking_cannot_suffice():
    # 80 GiB - 77 GiB guaranteed - 0.5 GiB headroom = 2.5 GiB: room for two 1 GiB minimums, not three.
    jobs = [guar(77), opp("201", 2.0), opp("203", 4.0), opp("202", 3.0)]
    d = run(jobs, now=500.0)
    assert [r.job_id for r in d.new_preemptions] == ["203"]
    req = d.new_preemptions[0]
    assert req.deadline_unix == 500.0 + P.grace_s and "GPU 0" in req.reason
    assert d.limits["203"].mem_limit_bytes == P.min_opportunistic_bytes
    assert d.limits["201"].mem_limit_bytes >= P.min_opportunistic_bytes
    # Next decision: the request is remembered, not repeated.
    d2 = run(jobs, d.state, now=501.0)
    assert d2.new_preemptions == () and "203" in d2.state.preempted
    # Even more demand: the next newest goes too.
    d3 = run([guar(78.2), *jobs[1:]], d2.state, now=502.0)
    assert [r.job_id for r in d3.new_preemptions] == ["202"]


def _slow_at_floor(params=P, start=0.0, ms=110.0, steps=40, jobs_opp=(("201", 2.0), ("202", 3.0))):
    """A guaranteed job measured alone at 100 ms, then ``ms`` beside the opportunistic jobs, one
    report a second; returns the decisions."""
    d = solo(params=params, now=start)
    out = []
    for i in range(steps):
        # Each report covers 10 mini-batches (about a second of them, as the agent's at ~10 Hz).
        d = run([guar(10, 10 * (i + 1), ms), *(opp(j, t) for j, t in jobs_opp)], d.state, now=start + 1 + i,
                params=params)
        out.append(d)
    return out


def test_preempt_newest_when_the_floor_share_is_not_enough():
    params = NodePolicyParams(slow_preempt_s=20.0)
    ds = _slow_at_floor(params, steps=70)
    floor_at = next(i for i, d in enumerate(ds) if d.state.gpu_budget[0] <= P.min_share)
    asked = [(i, r) for i, d in enumerate(ds) for r in d.new_preemptions]
    # The newest goes first, once the guaranteed job has been over target at the floor for 20 s ...
    (i, req), *rest = asked
    assert req.job_id == "202" and i - floor_at >= 20 - 1
    assert "guaranteed job 100 runs 10.0% slower than alone (target 2%)" in req.reason
    assert "minimum compute share 5%" in req.reason and req.deadline_unix == req.requested_unix + P.grace_s
    # ... and the next one only after a whole further period without relief.
    assert [r.job_id for _, r in rest] == ["201"] and rest[0][0] - i >= 20
    # A job asked to leave is held at the minimum until Slurm requeues it.
    assert ds[i + 1].limits["202"].compute_share == P.min_share


def test_relief_or_no_limit_means_no_preemption_for_speed():
    # Over target only briefly: the loop's backoff brings it under, nobody is preempted.
    params = NodePolicyParams(slow_preempt_s=20.0)
    d = run([guar(10, 1, 100.0)], now=0.0, params=params)
    for i in range(60):
        ms = 110.0 if i % 15 < 10 else 100.5   # relief every 15 s
        d = run([guar(10, i + 2, ms), opp("201", 2.0)], d.state, now=1.0 + i, params=params)
        assert not d.new_preemptions, i
    # Throttle-only sites: never.
    assert not any(d.new_preemptions for d in _slow_at_floor(NodePolicyParams(slow_preempt_s=None), steps=300))
    # Not slow, only at the floor from an earlier phase: nothing either.
    assert not any(d.new_preemptions for d in _slow_at_floor(params, ms=100.5, steps=60))


def test_no_guaranteed_job_means_full_share():
    d = run([opp("201", 2.0)])
    assert d.limits["201"].compute_share == 1.0
    assert d.limits["201"].mem_limit_bytes == 80 * GiB - P.headroom_bytes


def test_multi_gpu_job_takes_tightest_gpu():
    gpus = (GpuInfo(0, 80 * GiB), GpuInfo(1, 40 * GiB))
    d = run([opp("201", 2.0, gpus=(0, 1))], gpus=gpus)
    assert d.limits["201"].mem_limit_bytes == 40 * GiB - P.headroom_bytes


def test_state_forgets_retired_jobs():
    d = run([guar(77), opp("201", 2.0), opp("202", 3.0), opp("203", 4.0)])
    assert "203" in d.state.preempted
    d = run([guar(10)], d.state)
    assert d.state.preempted == {} and set(d.state.guaranteed) == {"100"}


# --- placement ---------------------------------------------------------------------------------

def load(i, used_gib=0, util=0.0, g=0, o=0):
    return GpuLoad(i, 80 * GiB, int(used_gib * GiB), util, g, o)


def test_choose_most_predicted_progress_then_spare_memory():
    # Beside a guaranteed job the 2 % target leaves 0.02 / util: the least busy GPU promises most.
    gpus = [load(0, 40, 0.1, g=1), load(1, 10, 0.5, g=1), load(2, 10, 0.2, g=1)]
    assert choose_gpus(gpus, 1, 2, 0.8, 10).gpus == [0]
    assert choose_gpus(gpus, 3, 2, 0.8, 10).gpus == [0, 2, 1]
    # An idle GPU beats any shared one; equal promise goes to the most spare memory.
    gpus = [load(0, 10, 0.1, o=1), load(1, 0, 0.0), load(2, 40, 0.1, o=1)]
    assert choose_gpus(gpus, 3, 2, 0.8, 10).gpus == [1, 0, 2]


def test_choose_waits_out_gpus_under_min_progress_and_avoids_where_it_crawled():
    gpus = [load(0, 0, 0.5, g=1), load(1, 0, 0.6, o=1), load(2, 0, 0.0)]
    p = choose_gpus(gpus, 1, 2, 0.8, 10, min_progress=0.25, avoid=[2])
    # GPU 2 is idle but the job crawled there; GPU 0 promises 0.04 beside its guaranteed job.
    assert p.gpus == [1] and p.placement == "fit"
    p = choose_gpus(gpus, 2, 2, 0.8, 10, min_progress=0.25, avoid=[2])
    assert p.gpus == [1, 0] and p.placement == "fallback"
    assert "predicted progress 0.04 < 0.25" in p.note


def test_choose_skips_busy_full_and_doubly_guaranteed():
    gpus = [load(0, 0, 0.9), load(1, 0, 0.1, o=2), load(2, 0, 0.1, g=2), load(3, 70, 0.7, g=1, o=1)]
    p = choose_gpus(gpus, 1, 2, 0.8, 10)
    assert (p.gpus, p.placement, p.note) == ([3], "fit", "")


def test_choose_fallback_least_loaded_and_says_why():
    gpus = [load(0, 0, 0.95, g=1), load(1, 0, 0.85, g=1, o=2)]
    p = choose_gpus(gpus, 1, 2, 0.8, 10)
    assert p.placement == "fallback" and p.gpus == [0]
    assert "utilisation 0.95 > 0.80 over 10 s" in p.note
    p2 = choose_gpus(gpus, 2, 2, 0.8, 10)
    assert sorted(p2.gpus) == [0, 1] and "2/2 opportunistic slots taken" in p2.note


# --- opportunistic progress and crawling -------------------------------------------------------


def opp_at(job_id: str, t: float, iteration: int, ms: float, gpus=(0,)) -> JobInfo:
    return JobInfo(job_id, "opportunistic", gpus, t, 2 * GiB, iteration, ms)


def test_opportunistic_jobs_alone_together_are_not_throttled_and_progress_is_measured():
    # Each alone first (its solo time), then together on one GPU with no guaranteed job.
    both = [opp_at("201", 1.0, 2, 150.0), opp_at("202", 2.0, 2, 75.0)]
    state = PolicyState(opportunistic={"201": run([opp_at("201", 1.0, 1, 100.0)]).state.opportunistic["201"],
                                       "202": run([opp_at("202", 2.0, 1, 50.0)]).state.opportunistic["202"]})
    d = run(both, state=state)
    assert d.limits["201"].compute_share == 1.0 and d.limits["202"].compute_share == 1.0
    assert d.progress == pytest.approx({"201": 100 / 150, "202": 50 / 75})
    assert d.state.crawling == {}  # 0.67 + 0.67 > 1: sharing pays


def test_sharing_that_is_a_loss_makes_the_newest_crawl():
    state = PolicyState(opportunistic={
        "201": run([opp_at("201", 1.0, 1, 100.0)]).state.opportunistic["201"],
        "202": run([opp_at("202", 2.0, 1, 100.0)]).state.opportunistic["202"]})
    slow = [opp_at("201", 1.0, 2, 260.0), opp_at("202", 2.0, 2, 300.0)]
    d = run(slow, state=state, now=500.0)
    assert d.state.crawling == {"202": 500.0}  # 0.38 + 0.33 < 1: the one making the least
    d = run([opp_at("201", 1.0, 3, 260.0), opp_at("202", 2.0, 3, 300.0)], state=d.state, now=600.0)
    assert d.state.crawling == {"202": 500.0}  # since when, kept
    d = run([opp_at("201", 1.0, 4, 150.0), opp_at("202", 2.0, 4, 150.0)], state=d.state, now=700.0)
    assert d.state.crawling == {}
    # Equal progress: the newest.
    d = run([opp_at("201", 1.0, 5, 300.0), opp_at("202", 2.0, 5, 300.0)], state=d.state, now=800.0)
    assert d.state.crawling == {"202": 800.0}


def test_a_job_reporting_itself_slow_cannot_make_its_neighbour_crawl():
    """Progress comes from each job's own reports. An older job that claims to be crawling (its
    reports are its own to forge) pushes the pair's sum under 1, and must get only itself moved."""
    state = PolicyState(opportunistic={
        "201": run([opp_at("201", 1.0, 1, 100.0)]).state.opportunistic["201"],
        "202": run([opp_at("202", 2.0, 1, 100.0)]).state.opportunistic["202"]})
    liar = opp_at("201", 1.0, 2, 1e9)     # "I make no progress at all"
    honest = opp_at("202", 2.0, 2, 125.0)  # 0.8 of its solo rate: sharing costs it little
    d = run([liar, honest], state=state, now=500.0)
    assert d.progress["202"] == pytest.approx(0.8)
    assert "202" not in d.state.crawling and "201" in d.state.crawling


def test_opportunistic_job_at_the_floor_beside_a_guaranteed_job_crawls():
    # Never alone: its best time stands in for its solo time, capped by its share.
    params = NodePolicyParams(initial_share=0.05)
    d = solo(params=params)
    d = run([guar(iteration=2, ms=104.0), opp_at("201", 5.0, 1, 900.0)], state=d.state, params=params, now=10.0)
    assert d.limits["201"].compute_share == params.min_share
    assert d.progress["201"] == pytest.approx(0.05)
    assert d.state.crawling == {"201": 10.0}
    # A job whose own iteration time is unknown is not judged.
    d = run([guar(iteration=3, ms=104.0), opp("202", 6.0)], state=d.state, params=params, now=20.0)
    assert "202" not in d.progress and "202" not in d.state.crawling


def test_choose_gpus_can_make_an_opportunistic_job_wait_instead_of_crawling():
    idle = GpuLoad(3, 80 << 30, 0, 0.0, 0, 0)
    busy = GpuLoad(0, 80 << 30, 20 << 30, 0.9, 1, 0)     # a guaranteed job keeps it 90 % busy
    quiet = GpuLoad(1, 80 << 30, 20 << 30, 0.3, 1, 0)    # utilisation under the threshold, but beside it
    # the 2 % slowdown target leaves 0.07 of a share, under min_progress: it would crawl there too
    fallback = choose_gpus([busy, quiet, idle], 2, 2, 0.8, 10, 0.02, 0.25)
    assert fallback.placement == "fallback" and fallback.gpus[0] == 3 and len(fallback.gpus) == 2
    wait = choose_gpus([busy, quiet, idle], 2, 2, 0.8, 10, 0.02, 0.25, wait_without_room=True)
    assert wait.placement == "wait" and wait.gpus == [3]
    assert "1 of 2 GPU(s)" in wait.note and "waits for room" in wait.note and "GPU 0: utilisation 0.90" in wait.note
    # Enough room: the same choice either way.
    both = choose_gpus([busy, idle, GpuLoad(4, 80 << 30, 0, 0.0, 0, 0)], 2, 2, 0.8, 10, 0.02, 0.25,
                       wait_without_room=True)
    assert both.placement == "fit" and sorted(both.gpus) == [3, 4]


def test_waiting_never_turns_placement_memory_into_a_ban():
    """A job preempted from the only GPU of its node is placed there again once that GPU qualifies
    (placement memory is a preference); while another GPU qualifies, that one is taken."""
    only = GpuLoad(0, 80 << 30, 0, 0.0, 0, 0)
    again = choose_gpus([only], 1, 2, 0.8, 10, 0.02, 0.25, avoid={0}, wait_without_room=True)
    assert (again.placement, again.gpus) == ("fit", [0]) and "taken again" in again.note
    other = GpuLoad(1, 80 << 30, 0, 0.0, 0, 0)
    assert choose_gpus([only, other], 1, 2, 0.8, 10, 0.02, 0.25, avoid={0}, wait_without_room=True).gpus == [1]
    busy = GpuLoad(0, 80 << 30, 20 << 30, 0.9, 1, 0)  # avoided and over the threshold: still wait
    assert choose_gpus([busy], 1, 2, 0.8, 10, 0.02, 0.25, avoid={0}, wait_without_room=True).placement == "wait"


def _pausable(job_id: str, t: float) -> JobInfo:
    return JobInfo(job_id, "opportunistic", (0,), t, 2 * GiB, None, None, can_pause=True)


PAUSE = NodePolicyParams(pause_max_s=120.0, resume_hold_s=10.0)


def test_a_memory_burst_pauses_the_newest_pausable_job_instead_of_requeuing_it():
    # 80 GiB GPU: the guaranteed job's burst to 78 GiB leaves under one job's minimum for two.
    jobs = [guar(78), _pausable("201", 2.0), _pausable("202", 3.0)]
    d = run(jobs, params=PAUSE)
    assert not d.new_preemptions
    assert [(r.job_id, r.gpu) for r in d.new_pauses] == [("202", 0)]
    assert "guaranteed demand 79872 MiB" in d.new_pauses[0].reason
    assert "202" in d.state.paused and "201" not in d.state.paused
    # Without pause support, or with pausing off, the same burst requeues as before.
    assert [r.job_id for r in run([guar(78), opp("201", 2.0), opp("202", 3.0)], params=PAUSE).new_preemptions] == ["202"]
    assert [r.job_id for r in run(jobs).new_preemptions] == ["202"]


def test_a_task_of_an_elastic_array_is_asked_to_leave_not_paused():
    """Pausing one task would stall every rank of its training; its requeue is a shrink (docs/elastic.md)."""
    import dataclasses

    task = dataclasses.replace(_pausable("202", 3.0), elastic_group="500")
    d = run([guar(78), _pausable("201", 2.0), task], params=PAUSE)
    assert not d.new_pauses and "202" not in d.state.paused
    assert [r.job_id for r in d.new_preemptions] == ["202"]


def test_a_paused_job_resumes_after_the_burst_has_passed_for_the_hold_time():
    jobs = [guar(78), _pausable("201", 2.0), _pausable("202", 3.0)]
    d = run(jobs, params=PAUSE, now=1000.0)
    calm = [guar(10), _pausable("201", 2.0), _pausable("202", 3.0)]
    d = run(calm, d.state, params=PAUSE, now=1005.0)   # fits again: the hold starts
    assert d.resumes == () and d.state.paused["202"].fits_since_unix == 1005.0
    d = run(jobs, d.state, params=PAUSE, now=1008.0)   # a new burst inside the hold: it starts over
    assert d.resumes == () and d.state.paused["202"].fits_since_unix is None and not d.new_pauses
    d = run(calm, d.state, params=PAUSE, now=1010.0)
    d = run(calm, d.state, params=PAUSE, now=1019.0)
    assert d.resumes == ()
    d = run(calm, d.state, params=PAUSE, now=1020.0)
    assert d.resumes == ("202",) and "202" not in d.state.paused
    assert d.limits["202"].mem_limit_bytes > P.min_opportunistic_bytes  # its share of the room again


def test_a_pause_longer_than_pause_max_s_becomes_a_requeue():
    jobs = [guar(78), _pausable("201", 2.0), _pausable("202", 3.0)]
    d = run(jobs, params=PAUSE, now=1000.0)
    d = run(jobs, d.state, params=PAUSE, now=1119.0)
    assert not d.new_preemptions
    d = run(jobs, d.state, params=PAUSE, now=1120.0)
    assert [r.job_id for r in d.new_preemptions] == ["202"]
    assert "paused for 120 s, the most sidecar.pause_max_s allows" in d.new_preemptions[0].reason
    assert "202" not in d.state.paused and "202" in d.state.preempted


def test_explain_tells_a_pause_in_place_and_its_end(tmp_path):
    """What the coordinator writes when a sidecar reports a job paused, then not: explain's story, and
    a restarted coordinator does not mistake it for a decision to replay."""
    import json

    from slurm_antman.coordinator import audit
    from slurm_antman.coordinator.daemon import restore_state
    from slurm_antman.coordinator.explain import explain

    path = tmp_path / "audit.jsonl"
    log = audit.AuditLog(path)
    log.append({"ts": 1000.0, "kind": "paused", "job_id": "202", "node": "n1", "params": {},
                "reason": "GPU 0: guaranteed demand 79872 MiB leaves 1536 MiB", "outcome": "ok"})
    log.append({"ts": 1030.0, "kind": "resumed", "job_id": "202", "node": "n1", "params": {},
                "reason": "its GPU had room for it again", "outcome": "ok"})
    log.close()
    text, rc = explain("202", str(path))
    assert rc == 0 and "paused in place on n1 by its sidecar" in text and "resumed on n1" in text
    assert "why: GPU 0: guaranteed demand 79872 MiB" in text
    doc = json.loads(explain("202", str(path), as_json=True)[0])
    assert [r["kind"] for r in doc["pauses"]] == ["paused", "resumed"] and doc["decisions"] == []
    assert restore_state(str(path), 30.0)[1] == 0


def test_beside_a_guaranteed_job_a_job_at_under_half_pace_crawls_and_elsewhere_under_the_floor():
    from slurm_antman.policy.node.core import crawl_threshold, crawling

    p = NodePolicyParams()
    assert (p.min_progress, p.crawl_below) == (0.25, crawl_threshold(0.25, 2.0)) == (0.25, 0.5)
    progress = {"201": 0.45, "202": 0.55, "301": 0.45, "302": 0.9}
    order = {0: ["201", "202"], 1: ["301", "302"]}
    # GPU 0 holds a guaranteed job: under 0.5 crawls (a free GPU would double it), 0.55 does not.
    # GPU 1 holds none: 0.45 is over the floor, and the pair's 1.35 says sharing pays: nobody crawls.
    assert crawling(progress, order, {0}, {}, 10.0, p) == {"201": 10.0}
    # What a site sets: a higher floor, or a move that must promise more, moves the line.
    assert crawl_threshold(0.6, 2.0) == 0.6 and crawl_threshold(0.25, 4.0) == 0.25


def test_the_sidecar_takes_the_crawl_line_from_the_floor_and_the_coordinators_move_gain():
    from slurm_antman import config as cfgmod
    from slurm_antman.sidecar.cli import policy_params

    nodes = [{"name": "n1", "gpus": 2}]
    assert policy_params(cfgmod.parse({"nodes": nodes})).crawl_below == 0.5
    mine = cfgmod.parse({"nodes": nodes, "opportunistic": {"min_progress": 0.1, "move_gain": 5}})
    assert (policy_params(mine).min_progress, policy_params(mine).crawl_below) == (0.1, 0.2)


def test_bursty_interference_that_a_median_passes_under_is_cut():
    """The devcluster replay's ResNet-50 beside gpt2_small on the contending emulated GPU (2026-11-26;
    docs/evaluation.md, "Why the replay's guaranteed jobs ran over their work"): two thirds of its
    reports at its solo time (129 ms), the rest one to four 49 ms kernels late. Every median of five
    read no slowdown and the share went up to 0.7; the mean is about 25 %, and the loop takes the share
    to its floor."""
    d = solo(ms=129.0)
    pattern = [129.0, 129.0, 178.0, 129.0, 129.0, 326.0, 129.0, 129.0, 227.0]
    ds = beside(d, pattern * 6, per=8)
    assert ds[-1].limits["201"].compute_share == P.min_share
    assert max(x.limits["201"].compute_share for x in ds) == P.initial_share  # never raised


def test_a_track_keeps_every_field_it_does_not_change():
    """track_report builds its new track field by field (for speed): a field added to GuaranteedTrack
    must not fall back to its default there. Every field set off its default, and a report that
    changes nothing but the demand (no new iteration): all else is kept."""
    from dataclasses import fields, replace

    from slurm_antman.policy.node.baseline import track_report
    from slurm_antman.policy.node.model import GuaranteedTrack

    odd = {"solo_ms": 7.0, "best_ms": 6.0, "last_iteration": 42, "demand_bytes": 5, "solo_samples": (7.0, 8.0),
           "episode_reports": 3, "episode_ms": 99.0, "episode_solo_ms": 77.0, "solo_busy_ms": 4.0,
           "solo_busy_samples": (4.0,), "probe_since": 12.5, "probed": True}
    assert set(odd) == {f.name for f in fields(GuaranteedTrack)}, "a new field: give it a value here"
    prev = GuaranteedTrack(**odd)
    job = JobInfo("g", "guaranteed", (0,), 0.0, 6, iteration=42, iteration_ms=9.0)
    for demand in (5, 6):  # unchanged: the same track; a new demand: a new one, the rest kept
        new, slowdown, _ = track_report(replace(job, mem_demand_bytes=demand), prev, True, False, NodePolicyParams())
        assert new == replace(prev, demand_bytes=demand) and slowdown is None
