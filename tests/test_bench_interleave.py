"""``antman bench interleave``: its flags, and one short run of the three modes on a contending
emulated GPU (the numbers are the benchmark's to report; here only what must hold in any run)."""

from __future__ import annotations

import pytest

from slurm_antman.lab.bench import interleave as il


@pytest.mark.parametrize("argv, msg", [
    (["--window-s", "0"], "--window-s must be a positive number"),
    (["--g-kernel-ms", "x"], "--g-kernel-ms must be a number"),
])
def test_bad_flags_are_named(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        il.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_out_of_range_values_are_named(capsys):
    assert il.main(["--g-stall-jitter", "1.5"]) == 2
    assert "--g-stall-jitter must be in [0, 1], got 1.5" in capsys.readouterr().err
    assert il.main(["--duty-share", "2"]) == 2
    assert "--duty-share must be in (0, 1], got 2.0" in capsys.readouterr().err


@pytest.mark.slow  # 16 s of three processes on the contending device
def test_three_modes_run_and_slot_filling_launches_only_through_the_gate(tmp_path):
    out = tmp_path / "il.json"
    args = il._parser().parse_args(["--window-s", "2.5", "--g-gpu-ms", "20", "--g-kernel-ms", "5",
                                    "--g-stall-ms", "20", "--o-gpu-ms", "10", "--out", str(out)])
    doc = il.measure(args, log=lambda s: None)
    assert set(doc["modes"]) == set(il.MODES)
    alone = doc["modes"]["alone"]
    # Alone, the guaranteed job's device phase is its 20 ms of kernels (plus the device's bookkeeping).
    assert 20.0 <= alone["guaranteed"]["busy_ms"] < 40.0
    assert 15.0 <= alone["guaranteed"]["stall_ms"] <= 25.0  # drawn from 20 ms x [0.8, 1.2]
    slots = doc["modes"]["slots"]["opportunistic"]
    # Every module of the opportunistic job went through the gate, and it waited for slots: the
    # guaranteed job was busy about half the time.
    assert slots["gate_launches"] > 0 and slots["gate_waited_s"] > 0.1
    assert slots["gate_launches"] >= 5 * (doc["modes"]["slots"]["opportunistic"]["iterations"])
    assert doc["modes"]["duty"]["opportunistic"]["mean_share"] is not None
    for mode in ("duty", "slots"):
        assert doc["modes"][mode]["guaranteed_slowdown"] is not None
        assert 0.0 <= doc["modes"][mode]["opportunistic_progress"] <= 1.2
    assert set(doc["targets"]) == {"slots_guaranteed_slowdown_le_1.02", "slots_progress_over_duty",
                                   "slots_progress_ge_5x_duty"}
