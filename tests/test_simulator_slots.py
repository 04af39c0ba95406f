"""The simulator's slot-filling compute mode (simulator/slot_fill.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_antman.lab.bench import simulate as bench_simulate
from slurm_antman.lab.evaluation import traces
from slurm_antman.lab.evaluation.simulator import SimConfig
from slurm_antman.lab.evaluation.simulator.engine import Simulator
from slurm_antman.lab.evaluation.simulator.slot_fill import LEAK_EMULATED, SlotFillParams, slot_rates
from slurm_antman.policy.progress import FILL_EFFICIENCY_EMULATED

# The emulated GPU's parameters: the arithmetic below is the same for any, and these leave room to see it.
P = SlotFillParams(FILL_EFFICIENCY_EMULATED, LEAK_EMULATED)


def test_one_opportunistic_job_fills_what_the_guaranteed_job_leaves_idle():
    g, (o,) = slot_rates(0.5, [1.0], P)
    assert o == pytest.approx(P.fill_efficiency * 0.5)
    assert g == pytest.approx(1 / (1 + P.leak))
    # A job that needs the device a fifth of its time is sated by less: it runs at full speed.
    assert slot_rates(0.5, [0.2], P)[1] == [1.0]
    # No idle time, nothing filled, and then nothing leaks either.
    assert slot_rates(1.0, [1.0], P) == (1.0, [0.0])
    # A paused job (duty 0 here) takes no device time.
    assert slot_rates(0.5, [0.0], P) == (1.0, [0.0])


def test_the_idle_time_is_water_filled_by_device_time():
    idle = P.fill_efficiency * 0.6
    _, (a, b) = slot_rates(0.4, [0.1, 1.0], P)
    assert a == 1.0  # needs 0.1 of the device, under an even part: sated
    assert b == pytest.approx(idle - 0.1)
    _, (c, d) = slot_rates(0.4, [1.0, 1.0], P)
    assert c == d == pytest.approx(idle / 2)


def test_bad_parameters_are_named():
    with pytest.raises(ValueError, match=r"--fill-efficiency must be in \(0, 1\], got 1.5"):
        SimConfig(compute="slots", slot_fill=SlotFillParams(1.5, 0.0))
    with pytest.raises(ValueError, match="--compute 'fast' is not allowed; allowed: duty, slots"):
        SimConfig(compute="fast")


HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"


def test_beside_a_guaranteed_job_an_opportunistic_job_progresses_faster_filling_slots(tmp_path: Path):
    # One GPU: tenant a's job is guaranteed (its quota), tenant a's second job opportunistic beside it.
    p = tmp_path / "t.csv"
    rows = [("2017-10-01 00:00:00", 36000, 1, "aaaa01"), ("2017-10-01 00:00:10", 3600, 1, "aaaa01")]
    p.write_text(HEADER + "".join(f"{t},{d},{g},{d * g},{c}\n" for t, d, g, c in rows))
    jobs = traces.load_sorted(p)
    out = {}
    for mode, params in (("duty", P), ("slots", P), ("slots, H100", SlotFillParams())):
        cfg = SimConfig(policy="antman", nodes=1, gpus_per_node=1, seed=3, compute=mode.split(",")[0],
                        slot_fill=params)
        res = Simulator(jobs, cfg).run()
        out[mode] = {r["job_id"]: r for r in res.jobs}
    second = sorted(out["duty"])[1]
    assert out["duty"][second]["class"] == out["slots"][second]["class"] == "opportunistic"
    # Under the duty throttle's prediction the GPU promises too little beside the guaranteed job, so
    # the job waits for it; filling its idle slots, it starts at once and is done long before.
    assert out["duty"][second]["first_start_s"] >= 36000.0
    assert out["slots"][second]["first_start_s"] == 10.0
    assert out["slots"][second]["end_s"] < out["duty"][second]["end_s"] / 5
    # With what an H100 filled (0.272 of the idle time) the promise is under the floor again: it waits.
    assert out["slots, H100"][second]["first_start_s"] >= 36000.0
    first = sorted(out["duty"])[0]
    # The guaranteed job pays the leak and no more.
    g_run = out["slots"][first]["end_s"] - out["slots"][first]["first_start_s"]
    assert g_run <= 36000 * (1 + P.leak) + 1


def test_the_command_line_takes_the_mode_and_its_parameters():
    a = bench_simulate._parser().parse_args(["--trace", "x", "--compute", "slots", "--fill-efficiency", "0.5",
                                             "--slot-leak", "0.01"])
    assert (a.compute, a.fill_efficiency, a.slot_leak) == ("slots", 0.5, 0.01)


def test_placement_predicts_slot_filling_only_when_it_is_on():
    from slurm_antman.policy.progress import predicted_progress

    assert predicted_progress(0.5, 1, 0, 0.02) == pytest.approx(0.04)
    assert predicted_progress(0.5, 1, 0, 0.02, fill=0.69) == pytest.approx(0.345)
    assert predicted_progress(0.5, 1, 1, 0.02, fill=0.69) == pytest.approx(0.345 / 2)
    assert predicted_progress(0.5, 0, 1, 0.02, fill=0.69) == pytest.approx(1 / 1.5)  # no guaranteed job: unchanged
    assert SimConfig(compute="slots").fill == SlotFillParams().fill_efficiency and SimConfig().fill == 0.0


def test_the_real_paths_placement_counts_slot_filling_when_the_site_turns_it_on():
    from slurm_antman import config as cfgmod
    from slurm_antman.policy.cluster.model import PolicyParams
    from slurm_antman.policy.node.core import GiB
    from slurm_antman.policy.node.placement import GpuLoad, choose_gpus
    from slurm_antman.policy.progress import FILL_EFFICIENCY, FILL_EFFICIENCY_EMULATED

    # A GPU half busy with a guaranteed job: the duty throttle promises 0.04, under the floor of 0.25,
    # so the job waits; filling slots as well as the emulated GPU does promises 0.345, so it is placed
    # there; as well as the H100 did, 0.136, still under the floor: it waits.
    gpus = [GpuLoad(0, 80 * GiB, 10 * GiB, 0.5, 1, 0)]
    assert choose_gpus(gpus, 1, 2, 0.8, 10, 0.02, 0.25, wait_without_room=True).placement == "wait"
    assert choose_gpus(gpus, 1, 2, 0.8, 10, 0.02, 0.25, wait_without_room=True,
                       fill=FILL_EFFICIENCY_EMULATED).gpus == [0]
    assert choose_gpus(gpus, 1, 2, 0.8, 10, 0.02, 0.25, wait_without_room=True,
                       fill=FILL_EFFICIENCY).placement == "wait"
    assert choose_gpus(gpus, 1, 2, 0.8, 10, 0.02, 0.10, wait_without_room=True,
                       fill=FILL_EFFICIENCY).gpus == [0]  # under a floor of 0.1 it is placed
    nodes = [{"name": "n1", "gpus": 2}]
    assert PolicyParams.from_config(cfgmod.parse({"nodes": nodes})).slot_fill == 0.0
    on = cfgmod.parse({"nodes": nodes, "sidecar": {"slot_filling": True}})
    assert PolicyParams.from_config(on).slot_fill == FILL_EFFICIENCY
    # The config's default is the policy's constant (the config does not import the policy), and a
    # site's own measurement replaces it.
    assert on.sidecar.slot_fill_efficiency == FILL_EFFICIENCY
    mine = cfgmod.parse({"nodes": nodes, "sidecar": {"slot_filling": True, "slot_fill_efficiency": 0.5}})
    assert PolicyParams.from_config(mine).slot_fill == 0.5
    for bad in (0, 1.5):
        with pytest.raises(cfgmod.ConfigError, match="slot_fill_efficiency"):
            cfgmod.parse({"nodes": nodes, "sidecar": {"slot_fill_efficiency": bad}})
