"""The simulator's shortcuts give the answers of the long way, to the bit: EASY backfill's reservation
planned once per state (simulator/backfill.py) against planning it from scratch for every job, the kept
opportunistic placements (simulator/opp_place.py) against asking the node policy every time, and
``--jobs N`` (simulator/parallel.py) against one process. Each on random small traces."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import pytest

from slurm_antman.lab.evaluation import traces
from slurm_antman.lab.evaluation.simulator import POLICIES, SimConfig, simulate
from slurm_antman.lab.evaluation.simulator.backfill import split
from slurm_antman.lab.evaluation.simulator.config import WHOLE_GPU
from slurm_antman.lab.evaluation.simulator.engine import Simulator
from slurm_antman.lab.evaluation.simulator.parallel import simulate_many
from slurm_antman.lab.evaluation.simulator.state import Reservation

HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"


def random_trace(tmp_path: Path, seed: int, n: int = 60) -> list[traces.TraceJob]:
    """``n`` jobs over about an hour, 1 to 12 GPUs (a whole cluster of 3 x 4), minutes to hours long, three tenants: a queue that
    builds on a small cluster, wide jobs that wait for reservations, short ones that backfill."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        t = rng.randrange(0, 3600)
        g = rng.choice((1, 1, 1, 1, 2, 2, 3, 4, 4, 6, 8, 12))
        d = rng.choice((60.0, 300.0, 900.0, 3600.0, 20000.0, 100000.0)) * rng.uniform(0.5, 1.5)
        rows.append((f"2017-10-01 {t // 3600:02d}:{t % 3600 // 60:02d}:{t % 60:02d}", round(d, 1), g, "abc"[rng.randrange(3)]))
    p = tmp_path / f"t{seed}.csv"
    p.write_text(HEADER + "".join(f"{t},{d},{g},{d * g},{c}\n" for t, d, g, c in rows))
    return traces.load_sorted(p)


class FromScratch(Simulator):
    """Checks every reservation against the planning this project did before backfill.py: every running
    job's ends gathered from ``active`` and walked for this one job."""

    checked = 0

    def _reserve(self, j, plan):
        resv, plan = super()._reserve(j, plan)
        assert resv == self._reserve_from_scratch(j)
        FromScratch.checked += 1
        return resv, plan

    def _reserve_from_scratch(self, j) -> Optional[Reservation]:
        counts = split(j.job.gpus, self._nodes_for(j.job.gpus))
        free: dict[int, int] = {}
        for i in self.free_gpus:
            free[self.gpus[i].node] = free.get(self.gpus[i].node, 0) + 1
        whole = self.cfg.policy in WHOLE_GPU
        scav = self.cfg.policy == "scavenger"
        ends: list[tuple[float, int, int]] = []
        for x in self.active.values():
            if x.state != "RUNNING" or not (whole or x.klass == "guaranteed"):
                continue
            per_node: dict[int, int] = {}
            for i in x.gpus:
                per_node[self.gpus[i].node] = per_node.get(self.gpus[i].node, 0) + 1
            if scav and not self._is_high(x):
                t = self.now
            elif x.rate > 0:
                t = max(self.now, x.t_last) + max(x.work_left, 0.0) / x.rate
            else:
                continue
            ends.extend((t, n, k) for n, k in per_node.items())
        ends.sort()
        horizon = self.now + self.cfg.bf_window_s
        t, k = self.now, 0
        while True:
            nodes = self._pick_nodes(free, counts, one_switch=False)
            if nodes is not None:
                return Reservation(j.job.job_id, t, dict(zip(nodes, counts)))
            if k >= len(ends) or ends[k][0] > horizon:
                return None
            t = ends[k][0]
            while k < len(ends) and ends[k][0] == t:
                free[ends[k][1]] = free.get(ends[k][1], 0) + ends[k][2]
                k += 1


@pytest.mark.parametrize("policy", ["exclusive", "quota", "scavenger", "shared", "antman"])
def test_the_planned_reservation_is_the_one_planned_from_scratch(tmp_path, policy):
    FromScratch.checked = 0
    for seed in range(4):
        jobs = random_trace(tmp_path, seed)
        # A short window too, so that some reservations lie beyond it and the next job asks again.
        for window in (86400.0, 4000.0):
            # (quotas twice the cluster: guaranteed jobs wait for GPUs under shared and antman too)
            cfg = SimConfig(policy=policy, nodes=3, gpus_per_node=4, bf_window_s=window, nodes_per_switch=2,
                            elastic_share=0.5, quota_scale=2.0)
            r = FromScratch(jobs, cfg).run()
            assert r.metrics["jobs_done"] == len(jobs)
    assert FromScratch.checked > 0  # the cases did ask for reservations


@pytest.mark.parametrize("policy", ["shared", "antman"])
def test_kept_opportunistic_placements_are_what_the_node_policy_answers_now(tmp_path, policy, monkeypatch):
    from slurm_antman.lab.evaluation.simulator.opp_place import OpportunisticPlacement

    monkeypatch.setattr(OpportunisticPlacement, "check_caches", True)  # recompute every kept answer
    monkeypatch.setattr(OpportunisticPlacement, "checked", 0)
    monkeypatch.setattr(OpportunisticPlacement, "shapes_checked", 0)
    monkeypatch.setattr(OpportunisticPlacement, "nodes_checked", 0)
    for seed in range(4):
        jobs = random_trace(tmp_path, seed, n=80)
        for extra in ({}, {"elastic_share": 1.0, "utilisation": "saturated"}, {"no_room": "fallback"}):
            cfg = SimConfig(policy=policy, nodes=3, gpus_per_node=4, **extra)
            r = simulate(jobs, cfg)
            assert r.metrics["jobs_done"] == len(jobs)
    assert OpportunisticPlacement.checked > 100  # kept answers were used, and each was right
    # A one-node job's failure stood for its (GPUs, wait) until a node's room changed: each such shape
    # asked again failed again the long way, and none succeeded (opp_place's assertion).
    assert OpportunisticPlacement.shapes_checked > (10 if policy == "antman" else 0)
    # Across nodes, a failed shape's answers from nodes unchanged since were what those nodes answer now.
    assert OpportunisticPlacement.nodes_checked > 100


@pytest.mark.parametrize("policy", POLICIES)
def test_leaving_out_queues_that_cannot_start_changes_nothing(tmp_path, policy, monkeypatch):
    from slurm_antman.lab.evaluation.simulator.scheduler import SlurmScheduler

    drops = 0
    for seed in range(6):
        jobs = random_trace(tmp_path, seed, n=120)
        for extra in ({}, {"backfill": "first_fit"}, {"bf_window_s": 3000.0, "quota_scale": 2.0},
                      {"elastic_share": 1.0, "nodes_per_switch": 2}):
            cfg = SimConfig(policy=policy, nodes=3, gpus_per_node=4, **extra)
            dropped = SlurmScheduler.queues_dropped
            fast = simulate(jobs, cfg)
            drops += SlurmScheduler.queues_dropped - dropped
            monkeypatch.setattr(SlurmScheduler, "drop_queues", False)
            slow = simulate(jobs, cfg)
            monkeypatch.undo()
            assert _strip([fast]) == _strip([slow])
    assert drops > 0


def _strip(results):
    return [(r.policy, {k: v for k, v in r.metrics.items() if k != "wall_s"}, r.jobs) for r in results]


def test_jobs_2_gives_the_runs_of_jobs_1_in_the_same_order(tmp_path):
    jobs = random_trace(tmp_path, 7, n=50)
    cfgs = [SimConfig(policy=p, nodes=2, gpus_per_node=4) for p in POLICIES]
    cfgs.append(SimConfig(policy="antman", nodes=2, gpus_per_node=4, cycle_s=29.0))
    seen: dict[int, list] = {1: [], 2: []}
    one = simulate_many(jobs, cfgs, workers=1, done=lambda k, r: seen[1].append((k, r)))
    two = simulate_many(jobs, cfgs, workers=2, done=lambda k, r: seen[2].append((k, r)))
    assert _strip(one) == _strip(two)
    # each run handed to ``done`` once, as it ended, with its index among the configs
    for w, runs in ((1, one), (2, two)):
        assert sorted(k for k, _ in seen[w]) == list(range(len(cfgs)))
        assert all(_strip([r]) == _strip([runs[k]]) for k, r in seen[w])
    assert [r.policy for r in two] == list(POLICIES) + ["antman"]
    assert all(r.metrics["wall_s"] >= 0 for r in two)
    # and both are what simulate() gives in this process
    assert _strip([simulate(jobs, cfgs[0])]) == _strip(one[:1])
    with pytest.raises(ValueError, match="--jobs must be at least 1"):
        simulate_many(jobs, cfgs, workers=0)


def test_the_cli_with_jobs_2_writes_what_jobs_1_writes(tmp_path, capsys):
    import json

    from slurm_antman.lab.bench import simulate as bench_simulate

    random_trace(tmp_path, 3, n=40)
    base = ["--trace", str(tmp_path / "t3.csv"), "--nodes", "2", "--gpus", "4", "--policy", "all", "--perturb", "3",
            "--json"]
    docs = []
    for n in ("1", "2"):
        assert bench_simulate.main(base + ["--jobs", n]) == 0
        docs.append(json.loads(capsys.readouterr().out))

    def plain(doc):  # without the wall times and the --jobs setting itself
        doc["meta"].pop("jobs_at_once")
        doc["meta"].pop("command")
        doc["meta"].pop("load_s")
        for m in doc["policies"].values():
            m.pop("wall_s")
        return doc

    one, two = (plain(d) for d in docs)
    assert list(two["policies"]) == list(one["policies"]) and two == one
    assert sorted(one["meta"]["perturbed"]) == sorted(POLICIES)
    assert bench_simulate.main(base + ["--jobs", "0"]) == 2
    assert "--jobs must be at least 1" in capsys.readouterr().err
