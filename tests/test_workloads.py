"""The workload model's invariants: every profile fits a GPU, utilisation in (0, 1], sharing never
speeds a job up, assignment is deterministic and follows the documented mix."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest

from slurm_antman.evaluation import workloads
from slurm_antman.evaluation.workloads import MIN_GPU_MEMORY_BYTES, ZOO, assign

DOC = Path(__file__).resolve().parent.parent / "docs" / "workload_model.md"


def test_zoo_invariants():
    assert workloads.validate() == []
    assert len(ZOO) >= 10
    for p in ZOO:
        assert 0 < p.mem_bytes <= MIN_GPU_MEMORY_BYTES
        assert 0.0 < p.sm_util <= 1.0
        assert p.iter_ms > 0
    assert sum(p.weight for p in ZOO) == pytest.approx(1.0)


@pytest.mark.parametrize("load", [0.0, 0.1, 0.5, 1.0, 2.0, -0.3])
def test_slowdown_at_least_one_and_monotone(load):
    for p in ZOO:
        assert p.slowdown(load) >= 1.0
        assert p.slowdown(load + 0.1) >= p.slowdown(load)


def test_validate_catches_bad_profiles():
    bad = (workloads._p("huge", "x", 1, 1, 40.0, 1.5, 10.0, 1.0, 1.0),)
    problems = workloads.validate(bad)
    assert any("does not fit" in s for s in problems) and any("sm_util" in s for s in problems)


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
