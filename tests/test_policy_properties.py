"""Properties of the policy core on random snapshots (hypothesis)."""

from __future__ import annotations

import collections
import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_antman.policy.cluster import (
    CoordinatorState, GpuView, JobView, NodeView, PreemptNeed, Snapshot, decide,
)
from slurm_antman.lab.snapshots import GiB, PARAMS

NOW = 50_000.0
STATES = ("PENDING", "RUNNING", "RUNNING", "COMPLETING", "COMPLETED")
JOB_IDS = [str(i) for i in range(1, 11)]


@st.composite
def snapshots(draw) -> Snapshot:
    n_nodes = draw(st.integers(1, 3))
    jobs: list[JobView] = []
    for jid in draw(st.lists(st.sampled_from(JOB_IDS), unique=True, max_size=8)):
        state = draw(st.sampled_from(STATES))
        requested = draw(st.sampled_from(("guaranteed", "opportunistic", "auto", "none")))
        job_class = draw(st.sampled_from(("guaranteed", "opportunistic", "none")))
        start = draw(st.one_of(st.none(), st.floats(NOW - 5000, NOW))) if state != "PENDING" else None
        jobs.append(JobView(
            jid, draw(st.sampled_from(("a", "b", "c"))), "u", state, requested, job_class, draw(st.integers(0, 3)),
            f"n{draw(st.integers(0, n_nodes))}" if state != "PENDING" else None,
            draw(st.floats(0, NOW)), start, draw(st.integers(0, 2)),
            draw(st.one_of(st.none(), st.floats(NOW - 5000, NOW))), draw(st.booleans())))
    nodes = []
    for i in range(n_nodes):
        gpus = []
        for idx in range(draw(st.integers(0, 3))):
            placed = draw(st.lists(st.sampled_from(JOB_IDS), unique=True, max_size=3))
            split = draw(st.integers(0, len(placed)))
            gpus.append(GpuView(idx, 80 * GiB, draw(st.integers(0, 80)) * GiB, draw(st.floats(0, 1)),
                                tuple(placed[:split]), tuple(placed[split:])))
        nodes.append(NodeView(f"n{i}", tuple(gpus), draw(st.integers(0, 8)), draw(st.integers(0, 8)),
                              draw(st.one_of(st.none(), st.just(NOW - 1)))))
    needs = draw(st.lists(st.builds(
        PreemptNeed, st.sampled_from([f"n{i}" for i in range(n_nodes + 1)]), st.integers(0, 3),
        st.sampled_from(JOB_IDS), st.just("memory"), st.floats(NOW - 100, NOW)), max_size=4))
    quotas = draw(st.dictionaries(st.sampled_from(("a", "b")), st.integers(0, 4)))
    return Snapshot(NOW, tuple(jobs), tuple(nodes), quotas, tuple(needs))


def _check_cycle(snap: Snapshot, decisions) -> None:
    jobs = {j.job_id: j for j in snap.jobs}
    nodes = {n.name for n in snap.nodes}
    per_key = collections.Counter(d.key for d in decisions)
    assert all(c == 1 for c in per_key.values()), f"two decisions for one job/node: {decisions}"
    for d in decisions:
        if hasattr(d, "job_id"):
            assert d.job_id in jobs, f"{d.kind} for unknown job {d.job_id}"
        if getattr(d, "node", None) is not None:
            assert d.node in nodes, f"{d.kind} for unknown node {d.node}"
        if d.kind in ("preempt_notice", "requeue"):
            assert jobs[d.job_id].job_class == "opportunistic", f"{d.kind} for a {jobs[d.job_id].job_class} job"
            assert jobs[d.job_id].state == "RUNNING"


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(snapshots())
def test_one_cycle_is_well_formed_and_idempotent(snap):
    ds1, st1 = decide(snap, CoordinatorState.empty(), PARAMS)
    _check_cycle(snap, ds1)
    ds2, st2 = decide(snap, st1, PARAMS)
    _check_cycle(snap, ds2)
    first = {(d.key, d.signature) for d in ds1}
    repeated = [d for d in ds2 if (d.key, d.signature) in first]
    assert not repeated, f"repeated on the same snapshot and state: {repeated}"


@SETTINGS
@given(snapshots(), st.lists(st.floats(0, 100), min_size=1, max_size=5))
def test_each_job_is_noticed_and_requeued_at_most_once_per_incarnation(snap, steps):
    state = CoordinatorState.empty()
    seen: collections.Counter = collections.Counter()
    now = snap.now
    for dt in [0.0, *steps]:
        now += dt
        s = dataclasses.replace(snap, now=now)
        ds, state = decide(s, state, PARAMS)
        _check_cycle(s, ds)
        for d in ds:
            if d.kind in ("preempt_notice", "requeue", "make_eligible"):
                seen[(d.kind, d.job_id)] += 1
        # What is remembered is always about jobs in the snapshot.
        assert set(state.preempting) | set(state.requeued) <= {j.job_id for j in snap.jobs}
    assert all(c == 1 for c in seen.values()), seen
