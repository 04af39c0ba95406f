"""`antman bench elastic`'s judgement of a training record (the devcluster run itself is the bench,
and tests/test_cluster_elastic.py): what counts as a step lost, and when a repeat is allowed."""

from __future__ import annotations

from slurm_antman.lab.bench.elastic import CKPT_EVERY, GLOBAL_BATCH, lost_steps, log_time, steps

B = GLOBAL_BATCH


def step(n: int, t: float, width: int = 2, first: int | None = None) -> dict:
    first = (n - 1) * B if first is None else first
    return {"event": "step", "step": n, "world_size": width, "time": t, "first": first, "last": first + B - 1}


def start(resumed: int, t: float, width: int = 2) -> dict:
    return {"event": "start", "step": resumed, "world_size": width, "time": t}


def test_a_clean_record_through_a_width_change_loses_nothing():
    evs = [start(0, 0.0), step(1, 1.0), step(2, 2.0), start(2, 3.0, 1), step(3, 4.0, 1)]
    assert lost_steps(evs) == []
    assert [e["step"] for e in steps(evs, 1)] == [3] and [e["step"] for e in steps(evs, after=1.5)] == [2, 3]


def test_a_skipped_step_wrong_samples_or_a_late_resume_are_each_named():
    assert "never trained: [2]" in lost_steps([start(0, 0.0), step(1, 1.0), step(3, 2.0)])[0]
    assert "step 2 trained samples 0-31" in lost_steps([start(0, 0.0), step(1, 1.0), step(2, 2.0, first=0)])[0]
    # Resumed two steps back at a width change: the agent's checkpoint held step 2, so 1 is a loss.
    late = [start(0, 0.0), step(1, 1.0), step(2, 2.0), start(0, 3.0, 1), step(1, 4.0, 1), step(2, 5.0, 1)]
    assert any("width change" in p and "at most 1" in p for p in lost_steps(late))
    # Resumed past what was logged: steps skipped in the record's order.
    ahead = [start(0, 0.0), step(1, 1.0), start(5, 2.0), step(6, 3.0)]
    assert lost_steps(ahead)


def test_a_requeue_may_repeat_up_to_the_periodic_checkpoint():
    evs = [start(0, 0.0)] + [step(n, float(n)) for n in range(1, 16)] + [start(10, 20.0)] + \
          [step(n, 10.0 + n) for n in range(11, 13)]
    assert lost_steps(evs, requeued_at=[18.0]) == []
    assert lost_steps(evs)  # the same repeat at a width change is a loss
    far = [start(0, 0.0)] + [step(n, float(n)) for n in range(1, CKPT_EVERY + 3)] + [start(0, 30.0)] + [step(1, 31.0)]
    assert any("requeue" in p for p in lost_steps(far, requeued_at=[29.0]))


def test_log_time_reads_python_loggings_stamp():
    a = log_time("2026-11-26 07:09:26,822 antman.sidecar WARNING job 1: WIDTH 2 -> 1")
    b = log_time("2026-11-26 07:09:27,022 antman.sidecar INFO x")
    assert abs((b - a) - 0.2) < 1e-6
