"""The workload model's invariants: every profile fits a GPU, utilisation in (0, 1], sharing never
speeds a job up, assignment is deterministic and follows the documented mix."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest

from slurm_antman.lab.evaluation import published, workloads
from slurm_antman.lab.evaluation.workloads import MIN_GPU_MEMORY_BYTES, ZOO, assign

DOC = Path(__file__).resolve().parent.parent / "docs" / "workload_model.md"


def test_zoo_invariants():
    assert workloads.validate() == []
    assert len(ZOO) >= 10
    for p in ZOO:
        assert 0 < p.mem_bytes <= MIN_GPU_MEMORY_BYTES
        assert 0.0 < p.sm_util <= 1.0
        assert p.iter_ms > 0
    assert sum(p.weight for p in ZOO) == pytest.approx(1.0)


@pytest.mark.parametrize("share", [0.0, 0.05, 0.5, 1.0, -0.3])
def test_slowdown_at_least_one_and_monotone(share):
    for p in ZOO:
        for q in ZOO:
            assert p.slowdown([(q.kind, share)]) >= 1.0
            assert p.slowdown([(q.kind, share + 0.1)]) >= p.slowdown([(q.kind, share)])
            assert p.slowdown([(q.kind, share), (q.kind, 1.0)]) >= p.slowdown([(q.kind, share)])


def test_slowdown_beside_an_uncontrolled_neighbour_is_the_measured_pair():
    measured = published.pair_slowdowns()
    for p in ZOO:
        for q in ZOO:
            assert p.slowdown([(q.kind, 1.0)]) == pytest.approx(max(1.0, measured[(p.kind, q.kind)]))
    # ResNet-50 beside a Transformer, both as Gavel ran them: 3.757 of 7.787 mini-batches/s.
    r50, nmt = workloads.BY_NAME["resnet50"], workloads.BY_NAME["transformer_nmt"]
    assert r50.slowdown([(nmt.kind, 1.0)]) == pytest.approx(7.787264918596293 / 3.7572849330016997)
    # A throttled neighbour interferes only while it runs: the GPU work runs at 1 / d then; two
    # neighbours add their costs while both run.
    d = r50.slowdown([(nmt.kind, 1.0)])
    assert r50.slowdown([(nmt.kind, 0.1)]) == pytest.approx(1.0 / (0.9 + 0.1 / d))
    both = 0.1 * 0.2 / (2 * d - 1) + 0.1 * 0.8 / d + 0.9 * 0.2 / d + 0.9 * 0.8
    assert r50.slowdown([(nmt.kind, 0.1), (nmt.kind, 0.2)]) == pytest.approx(1.0 / both)
    assert r50.slowdown([]) == 1.0


def test_numbers_measured_on_the_same_model_are_the_measurement():
    """Profiles Gavel ran as the zoo runs them take its solo V100 mini-batch time."""
    for name, (job, how) in published.GAVEL_FOR_PROFILE.items():
        p = workloads.BY_NAME[name]
        assert p.kind == job
        if how.startswith("exact") or name == "transformer_nmt":
            assert p.iter_ms == pytest.approx(published.solo_ms(job), abs=0.05), name


def test_parameter_counts_are_the_built_models():
    from slurm_antman.lab.evaluation.model_zoo import PUBLISHED_PARAMS_M

    for p in ZOO:
        assert p.params_millions == pytest.approx(PUBLISHED_PARAMS_M[p.name], abs=0.05), p.name


def _fit_rank1(slowdown, iterations: int = 200):
    """``slowdown_ij - 1 = s_i * p_j`` fitted to the pairs by alternating least squares, p scaled so
    its largest is 1: the one-number-per-job formula the model used before the table."""
    def slope(points):
        den = sum(x * x for x, _ in points)
        return sum(x * y for x, y in points) / den if den > 0 else 0.0

    jobs = sorted({i for i, _ in slowdown} | {j for _, j in slowdown})
    s = p = {j: 1.0 for j in jobs}
    for _ in range(iterations):
        s = {i: slope([(p[j], d - 1.0) for (a, j), d in slowdown.items() if a == i]) for i in jobs}
        p = {j: slope([(s[i], d - 1.0) for (i, b), d in slowdown.items() if b == j]) for j in jobs}
    top = max(p.values())
    return {i: v * top for i, v in s.items()}, {j: v / top for j, v in p.items()}


def test_interference_fit_says_why_a_table_is_used():
    """A one-number-per-job formula (what the model used before) misfits Gavel's pairs badly; the
    table reproduces them exactly. Keeps the reason for the table checkable."""
    d = published.pair_slowdowns()
    s, pr = _fit_rank1(d)
    worst = max(abs(1.0 + s[i] * pr[j] - v) for (i, j), v in d.items())
    assert worst > 0.5
    assert max(pr.values()) == pytest.approx(1.0)


def test_validate_catches_bad_profiles():
    bad = (workloads._p("huge", "x", 1, 1, 40.0, 1.5, 10.0, "nope", 1.0),)
    problems = workloads.validate(bad)
    assert any("does not fit" in s for s in problems) and any("sm_util" in s for s in problems)
    assert any("kind 'nope' has no measured interference" in s for s in problems)


def test_assignment_deterministic_and_seeded():
    ids = [f"philly-{i}" for i in range(2, 500)]
    first = [assign(i).name for i in ids]
    assert first == [assign(i).name for i in ids]
    assert first != [assign(i, seed=1).name for i in ids]


def test_mix_proportions_on_large_sample():
    n = 40_000
    counts = collections.Counter(assign(f"job-{i}").name for i in range(n))
    for p in ZOO:
        # binomial standard deviation at n=40k is under 0.2 percentage points; allow 1
        assert abs(counts[p.name] / n - p.weight) < 0.01, p.name


def test_every_profile_documented():
    text = DOC.read_text()
    for p in ZOO:
        assert re.search(rf"\b{p.name}\b", text), f"{p.name} missing from {DOC}"
    assert "estimate" in text and "antman bench models" in text
    for source in ("9aef8421fd294d3867e81754519716c09ec5fe83", "Lucid", "DLPerf", "34323"):
        assert source in text
