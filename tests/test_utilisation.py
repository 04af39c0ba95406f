"""Production utilisation (evaluation.utilisation): the tables say what their sources say, draws are
deterministic per job, and the interference formula built on them reduces to the measured pairs."""

from __future__ import annotations

import pytest

from slurm_antman.lab.evaluation import utilisation, workloads
from slurm_antman.lab.evaluation.utilisation import PAI, PHILLY, Quantiles, draw, philly_table


def test_tables_reproduce_the_published_quantiles():
    one = PHILLY[1]
    assert one.at(0.1) == 0.0 and one.at(0.29) == 0.0  # 29 % of samples at 0
    assert one.at(0.5) == pytest.approx(0.55) and one.at(0.75) == pytest.approx(0.89)
    assert one.at(0.9) == pytest.approx(0.98) and one.at(1.0) == 1.0
    assert PAI.at(0.66) == pytest.approx(0.03) and PAI.at(0.9) == pytest.approx(0.58)
    # Philly's jobs keep their GPUs about half busy; PAI's tasks far less.
    for g, q in PHILLY.items():
        assert 0.44 < q.mean() < 0.51, g
    assert 0.15 < PAI.mean() < 0.18


def test_size_classes():
    assert philly_table(1) is PHILLY[1] and philly_table(2) is PHILLY[4] and philly_table(8) is PHILLY[8]
    assert philly_table(9) is PHILLY[16] and philly_table(128) is PHILLY[16]


def test_draws_are_deterministic_seeded_and_follow_the_table():
    ids = [f"philly-{k}" for k in range(20_000)]
    a = [draw(j, 1, "philly") for j in ids]
    assert a == [draw(j, 1, "philly") for j in ids]
    assert a != [draw(j, 1, "philly", seed=1) for j in ids]
    assert min(a) == utilisation.MIN_UTILISATION and max(a) <= 1.0
    assert sum(a) / len(a) == pytest.approx(PHILLY[1].mean(), abs=0.01)
    median = sorted(a)[len(a) // 2]
    assert median == pytest.approx(0.55, abs=0.02)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="utilisation source 'x'"):
        draw("1", 1, "x")
    with pytest.raises(ValueError, match="--utilisation 'busy'.*production, saturated"):
        utilisation.check_mode("busy")
    with pytest.raises(ValueError, match="non-decreasing"):
        Quantiles(((0.0, 0.5), (1.0, 0.2)))


def test_formula_scales_the_measured_pair_by_both_duties():
    r50, nmt = workloads.BY_NAME["resnet50"], workloads.BY_NAME["transformer_nmt"]
    d = r50.slowdown([(nmt.kind, 1.0)])  # Gavel's pair, both at full utilisation
    assert workloads.pair_slowdown(r50.kind, nmt.kind, 1.0, 1.0) == pytest.approx(d)
    # Work-conserving: the victim's GPU half runs at 1 - x + x / d while the neighbour is active x of
    # the time, its host half not at all.
    assert workloads.pair_slowdown(r50.kind, nmt.kind, 0.5, 0.5) == pytest.approx(0.5 + 0.5 / (0.5 + 0.5 / d))
    assert workloads.pair_slowdown(r50.kind, nmt.kind, 0.5, 0.5, share_neighbour=0.1) == pytest.approx(
        0.5 + 0.5 / (0.95 + 0.05 / d))
    # Below the old linear form (1 + b x (d - 1)) between the ends, equal at them.
    assert workloads.pair_slowdown(r50.kind, nmt.kind, 1.0, 0.5) < 1 + 0.5 * (d - 1)
    assert workloads.pair_slowdown(r50.kind, nmt.kind, 0.0, 1.0) == 1.0
    # The penalty beyond an even time slice: d - 2 (negative where the pair overlaps better).
    assert workloads.contention_penalty(r50.kind, nmt.kind) == pytest.approx(d - 2)
    assert workloads.contention_penalty("T64", "LM80") < 0
    # Profile.slowdown with duties is the same formula.
    assert r50.slowdown([(nmt.kind, 0.5 * 0.1)], duty=0.5) == pytest.approx(
        workloads.pair_slowdown(r50.kind, nmt.kind, 0.5, 0.5, share_neighbour=0.1))
    assert r50.duty(0.5) == pytest.approx(0.5) and workloads.BY_NAME["rl_ppo_atari"].duty(0.5) == 1.0


def test_several_neighbours_add_their_costs_only_while_active_together():
    r50 = workloads.BY_NAME["resnet50"]
    e = workloads.INTERFERENCE[(r50.kind, r50.kind)]
    # Two uncontrolled copies: a three-way slice, 1 + 2e, as the measured pair generalises.
    assert r50.slowdown([(r50.kind, 1.0), (r50.kind, 1.0)]) == pytest.approx(1 + 2 * e)
    # Two at load 0.5: active together a quarter of the time, alone each a quarter, neither a quarter.
    assert workloads.gpu_rate([(0.5, e), (0.5, e)]) == pytest.approx(0.25 + 0.5 / (1 + e) + 0.25 / (1 + 2 * e))
    # Beyond the exact limit, the mean field, never below the all-active rate.
    many = [(1.0, e)] * 12
    assert workloads.gpu_rate(many) == pytest.approx(1 / (1 + 12 * e))
    assert workloads.gpu_rate([(0.0, e), (0.3, 0.0)]) == 1.0


def test_share_curve_is_the_slowdown_of_one_throttled_neighbour():
    from slurm_antman.lab.evaluation.simulator.antman import curve_slowdown

    r50, lstm = workloads.BY_NAME["resnet50"], workloads.BY_NAME["lstm_lm"]
    a, q = r50.share_curve([(lstm.kind, 0.7)], 0.6)
    for share in (0.05, 0.3, 1.0):
        assert curve_slowdown(a, q, share) == pytest.approx(r50.slowdown([(lstm.kind, 0.7 * share)], 0.6))
