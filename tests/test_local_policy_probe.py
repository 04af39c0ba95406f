"""The guaranteed job's baseline probe in the pure node policy (NodePolicyParams.probe_share): a
guaranteed job that starts beside opportunistic jobs was never measured alone, so its first reports
are taken with its neighbours held, and the loop reads their interference against a real solo time."""

from __future__ import annotations

import pytest

from slurm_antman.policy.node.core import GiB, GpuInfo, JobInfo, NodePolicyParams, NodeSnapshot, PolicyState, decide

P = NodePolicyParams()
GPU0 = GpuInfo(0, 80 * GiB)
SOLO_MS = 100.0
BESIDE_MS = 130.0  # what the neighbour at its share costs the guaranteed job: 30 %


def guar(iteration=None, ms=None) -> JobInfo:
    return JobInfo("100", "guaranteed", (0,), 5.0, 10 * GiB, iteration, ms)


def opp(iteration=None, ms=None) -> JobInfo:
    return JobInfo("201", "opportunistic", (0,), 1.0, 2 * GiB, iteration, ms)


def run(jobs, state=None, now=1000.0, params=P):
    return decide(NodeSnapshot((GPU0,), tuple(jobs)), state or PolicyState(), params, now)


def started_beside(params=P, reports=40):
    """A guaranteed job that arrives on a GPU an opportunistic job already uses, and reports once a
    second: its iteration is SOLO_MS while the neighbour is held (share under 0.05), BESIDE_MS
    otherwise, as a device would make it. Returns every decision."""
    d = run([opp(1, 50.0)], now=990.0)  # the neighbour, alone first
    out, share = [], d.limits["201"].compute_share
    for i in range(reports):
        ms = SOLO_MS if share < P.min_share else BESIDE_MS
        # Each report covers 20 mini-batches (2 s), so the loop decides every slowdown_window reports.
        d = run([guar(20 * i, ms), opp(i + 2, 50.0 / max(share, 0.01))], d.state, now=1000.0 + i, params=params)
        share = d.limits["201"].compute_share
        out.append(d)
    return out


def test_a_guaranteed_job_started_beside_a_neighbour_is_measured_alone_first():
    ds = started_beside()
    # Its first report was taken at the neighbour's old share: the probe begins, that report is no
    # solo sample.
    assert ds[0].limits["201"].compute_share == P.probe_share
    assert ds[0].state.guaranteed["100"].probe_since == 1000.0
    assert ds[0].state.guaranteed["100"].solo_samples == ()
    # The next baseline_window reports are solo samples, the neighbour held throughout ...
    probing = [d for d in ds if d.state.guaranteed["100"].probe_since is not None]
    assert len(probing) == P.baseline_window + 1
    assert all(d.limits["201"].compute_share == P.probe_share for d in probing)
    done = ds[len(probing)]
    assert done.state.guaranteed["100"].solo_ms == SOLO_MS and done.state.guaranteed["100"].probed
    # ... then the loop starts where it always does, and reads the neighbour's 30 % as 30 %.
    assert done.limits["201"].compute_share == P.initial_share
    later = ds[len(probing) + P.slowdown_window]
    assert later.slowdown["100"] == pytest.approx(BESIDE_MS / SOLO_MS - 1)
    assert later.limits["201"].compute_share < P.initial_share
    assert ds[-1].limits["201"].compute_share == P.min_share


def test_without_the_probe_the_loop_reads_the_neighbour_as_the_baseline():
    """The failure the probe fixes: the best time seen beside the neighbour stands in for the solo
    time, so a constant 30 % reads as none, and the share only grows."""
    ds = started_beside(NodePolicyParams(probe_max_s=0), reports=60)
    assert all(d.slowdown.get("100", 0.0) == 0.0 for d in ds)
    assert ds[-1].limits["201"].compute_share == 1.0


def test_no_probe_before_the_first_report_nor_for_a_job_measured_alone():
    # Loading its data, the guaranteed job computes nothing: its neighbour is not held for it.
    d = run([guar(), opp(1, 50.0)])
    assert d.limits["201"].compute_share == P.initial_share
    assert d.state.guaranteed["100"].probe_since is None
    # A job with a full solo window when the neighbour arrives needs no probe.
    d = None
    for i in range(P.baseline_window):
        d = run([guar(i, SOLO_MS)], d.state if d else None)
    d = run([guar(P.baseline_window, SOLO_MS), opp(1, 50.0)], d.state)
    assert d.state.guaranteed["100"].probe_since is None
    assert d.limits["201"].compute_share == P.initial_share  # one report: no decision yet


def test_a_probe_ends_after_probe_max_s_and_is_not_begun_again():
    d = run([guar(0, SOLO_MS), opp(1, 50.0)], now=1000.0)
    assert d.limits["201"].compute_share == P.probe_share
    # The job reports no new iteration (hung, or a step of minutes): the neighbour is held no longer
    # than probe_max_s.
    d = run([guar(0, SOLO_MS), opp(2, 50.0)], d.state, now=1000.0 + P.probe_max_s - 1)
    assert d.limits["201"].compute_share == P.probe_share
    d = run([guar(0, SOLO_MS), opp(3, 50.0)], d.state, now=1000.0 + P.probe_max_s)
    assert d.limits["201"].compute_share == P.initial_share
    assert d.state.guaranteed["100"].probed and d.state.guaranteed["100"].probe_since is None
    # Its next reports do not begin another: the best time seen stands in, as before the probe.
    d = run([guar(1, BESIDE_MS), opp(4, 50.0)], d.state, now=1100.0)
    assert d.limits["201"].compute_share != P.probe_share
    assert d.state.guaranteed["100"].baseline_ms == SOLO_MS


def test_the_probe_ends_when_the_neighbours_leave_and_the_job_measures_alone():
    d = run([guar(0, SOLO_MS), opp(1, 50.0)])
    assert d.state.guaranteed["100"].probe_since is not None
    d = run([guar(1, SOLO_MS)], d.state, now=1001.0)
    assert d.state.guaranteed["100"].probe_since is None and d.state.guaranteed["100"].probed
    assert d.state.guaranteed["100"].solo_samples == (SOLO_MS,)


def test_a_held_neighbour_is_not_judged_crawling():
    """At the probe's share its pace is the probe's, not what the GPU gives it: the coordinator must
    not move it for that."""
    d = run([opp(1, 50.0)], now=990.0)
    d = run([guar(0, SOLO_MS), opp(2, 50.0)], d.state)
    d = run([guar(1, SOLO_MS), opp(3, 5000.0)], d.state, now=1001.0)
    assert d.limits["201"].compute_share == P.probe_share
    assert "201" not in d.progress and "201" not in d.state.crawling
