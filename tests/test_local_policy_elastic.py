"""Elastic width in the pure node policy (docs/elastic.md): an elastic job sheds the GPU a
guaranteed job claims instead of pausing or leaving, sheds the GPU it crawls on, and grows back onto
an idle GPU of its set once per hold."""

from __future__ import annotations

from dataclasses import replace

from slurm_antman.policy.node.core import (
    GiB, GpuInfo, GuaranteedTrack, JobInfo, NodePolicyParams, NodeSnapshot, PolicyState, decide,
)

P = NodePolicyParams(pause_max_s=120.0, elastic_hold_s=60.0)
GPUS = (GpuInfo(0, 80 * GiB), GpuInfo(1, 80 * GiB))


def guar(demand_gib: float, gpu: int = 1, iteration=None, ms=None) -> JobInfo:
    return JobInfo("100", "guaranteed", (gpu,), 1.0, int(demand_gib * GiB), iteration, ms)


def elastic(gpus=(0, 1), minimum=1, can_resize=True, job_id="201", **kw) -> JobInfo:
    return JobInfo(job_id, "opportunistic", tuple(gpus), 2.0, 2 * GiB, can_pause=True, elastic_min=minimum,
                   elastic_gpus=(0, 1), can_resize=can_resize, **kw)


def run(jobs, state=None, now=1000.0, params=P, gpus=GPUS):
    return decide(NodeSnapshot(tuple(gpus), tuple(jobs)), state or PolicyState(), params, now)


def measured(state: PolicyState, *job_ids: str, ms: float = 100.0) -> PolicyState:
    """``state`` with the guaranteed jobs' solo baselines known (their probe done: test_local_policy
    covers it), so that their first report beside the elastic job is read against ``ms``."""
    track = GuaranteedTrack(solo_ms=ms, best_ms=ms, solo_samples=(ms,) * P.baseline_window, probed=True)
    return replace(state, guaranteed={**state.guaranteed, **{j: track for j in job_ids}})


def test_a_guaranteed_burst_sheds_the_claimed_gpu_instead_of_pausing_the_job():
    d = run([guar(79), elastic()])
    assert not d.new_pauses and not d.new_preemptions
    assert [(c.job_id, c.gpus) for c in d.width_changes] == [("201", (0,))]
    assert "GPU(s) 1 needed" in d.width_changes[0].reason and "width 2 -> 1" in d.width_changes[0].reason
    assert d.state.width_changed == {"201": 1000.0}
    # It keeps GPU 0's room: its limit is GPU 0's, not the claimed GPU's minimum.
    assert d.limits["201"].mem_limit_bytes > 70 * GiB


def test_at_its_narrowest_width_or_without_a_launcher_the_job_goes_the_usual_way():
    narrow = run([guar(79), elastic(minimum=2)])
    assert not narrow.width_changes and [r.job_id for r in narrow.new_pauses] == ["201"]
    blind = run([guar(79), elastic(can_resize=False)])
    assert not blind.width_changes and [r.job_id for r in blind.new_pauses] == ["201"]
    one = run([guar(79, gpu=0), elastic(gpus=(0,))])
    assert not one.width_changes and [r.job_id for r in one.new_pauses] == ["201"]


def test_a_shed_never_waits_for_the_hold_but_a_grow_does():
    d = run([guar(79), elastic()])
    # The job now runs on GPU 0 alone; the guaranteed job leaves at once.
    d = run([elastic(gpus=(0,))], d.state, now=1010.0)
    assert not d.width_changes  # inside the hold
    d = run([elastic(gpus=(0,))], d.state, now=1059.0)
    assert not d.width_changes
    d = run([elastic(gpus=(0,))], d.state, now=1060.0)
    assert [(c.job_id, c.gpus) for c in d.width_changes] == [("201", (0, 1))]
    assert "GPU 1 is idle" in d.width_changes[0].reason
    # A second claim right after the grow sheds again at once: the guaranteed job never waits.
    d = run([guar(79), elastic()], d.state, now=1061.0)
    assert [c.gpus for c in d.width_changes] == [(0,)]


def test_it_grows_only_onto_an_idle_gpu_of_its_own_set_with_room():
    other = JobInfo("300", "opportunistic", (1,), 3.0, 2 * GiB, None, None)
    assert not run([elastic(gpus=(0,)), other]).width_changes          # GPU 1 holds another job
    assert not run([elastic(gpus=(0,)), guar(10)]).width_changes       # or a guaranteed one
    outside = replace(elastic(gpus=(0,)), elastic_gpus=(0,))
    assert not run([outside]).width_changes                            # GPU 1 is not in its set
    full = (GPUS[0], GpuInfo(1, 80 * GiB, foreign_bytes=79 * GiB))
    assert not run([elastic(gpus=(0,))], gpus=full).width_changes      # no room for its footprint
    # Two elastic jobs may not both take the one idle GPU in one call.
    two = [elastic(gpus=(0,)), elastic(gpus=(0,), job_id="202")]
    assert [c.job_id for c in run(two).width_changes] == ["201"]


def test_a_crawling_elastic_job_sheds_the_gpu_it_shares_with_a_guaranteed_job():
    # Solo baseline 100 ms on both GPUs; then a busy guaranteed job joins GPU 1 and the job crawls.
    d = run([elastic(iteration=1, iteration_ms=100.0)], now=900.0)
    d = run([guar(10, iteration=1, ms=100.0), elastic(iteration=2, iteration_ms=1000.0)], measured(d.state, "100"),
            now=1000.0)
    assert [(c.job_id, c.gpus) for c in d.width_changes] == [("201", (0,))]
    assert "crawling: GPU 1" in d.width_changes[0].reason
    assert "201" not in d.state.crawling  # nothing for the coordinator to move
    # Inside the hold of an earlier change it is left to the usual crawl handling.
    held = replace(d.state, width_changed={"201": 990.0})
    d2 = run([guar(10, iteration=1, ms=100.0), elastic(iteration=3, iteration_ms=1000.0)], held, now=1000.0)
    assert not d2.width_changes and "201" in d2.state.crawling


def test_the_hold_is_forgotten_with_the_job():
    d = run([guar(79), elastic()])
    assert "201" in d.state.width_changed
    assert run([guar(79)], d.state, now=1001.0).state.width_changed == {}


def test_a_job_shared_with_guaranteed_jobs_on_every_gpu_is_left_whole_for_a_move():
    """Shedding one of two GPUs that both hold a guaranteed job would leave it crawling at half width:
    it keeps its width, crawls, and the coordinator moves it whole."""
    g0 = replace(guar(10, gpu=0, iteration=1, ms=100.0), job_id="100")
    g1 = replace(guar(10, gpu=1, iteration=1, ms=100.0), job_id="101")
    d = run([elastic(iteration=1, iteration_ms=100.0)], now=900.0)
    d = run([g0, g1, elastic(iteration=2, iteration_ms=1000.0)], measured(d.state, "100", "101"), now=1000.0)
    assert not d.width_changes and "201" in d.state.crawling


def test_a_job_narrowed_for_good_crawls_at_its_width_and_grows_back_when_it_can():
    """At one of its two GPUs it trains at about half its full pace, however well that GPU does: its
    reported progress is scaled by its width, so it crawls (under 1 / move_gain) where nothing of its
    set is free, and grows instead where something is."""
    other = JobInfo("300", "opportunistic", (1,), 3.0, 2 * GiB, None, None)
    d = run([elastic(gpus=(0,), iteration=1, iteration_ms=100.0)], now=900.0)
    # GPU 1 taken by another job: 0.45 of full pace (0.9 on GPU 0, width 1 of 2) is crawling.
    d = run([elastic(gpus=(0,), iteration=2, iteration_ms=111.0), other], d.state, now=1000.0)
    assert d.progress["201"] < 0.5 and "201" in d.state.crawling and not d.width_changes
    # GPU 1 free again: it grows, and is no longer reported crawling.
    d = run([elastic(gpus=(0,), iteration=3, iteration_ms=111.0)], d.state, now=1100.0)
    assert [(c.job_id, c.gpus) for c in d.width_changes] == [("201", (0, 1))]
    assert "201" not in d.state.crawling
