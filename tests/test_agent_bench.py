"""`antman bench control --json` runs end to end and reports every key."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_control_quick_json():
    r = subprocess.run([sys.executable, "-c", "import sys; from slurm_antman.lab.bench.control import main; "
                        "sys.exit(main(['--json', '--quick']))"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for k in ("rtt_p50_us", "rtt_p99_us", "propagation_iterations", "throttle_error", "overhead_ratio"):
        assert k in res, k
    assert res["rtt_samples"] >= 90 and 0 < res["rtt_p50_us"] <= res["rtt_p99_us"]
    assert 0 < res["floor_rtt_p50_us"] <= res["floor_rtt_p99_us"]
    assert 0 < res["rtt_training_p50_us"] <= res["rtt_training_p99_us"]
    # The short loop exists to keep the wait for the boundary out of the round trip.
    assert res["rtt_loop_iteration_us"] < res["rtt_training_iteration_us"]
    assert res["propagation_iterations"] == 1
    # Timing targets are the benchmark's to report (docs/benchmarks.md), not this test's to assert:
    # here only that the numbers are measurements of the right kind.
    assert 0 <= res["throttle_error"] < 1
    assert set(res["throttle_duty"]) == {"0.25", "0.5", "0.75"}
    assert all(0 < d <= 1 for d in res["throttle_duty"].values())
    assert res["overhead_ratio"] > 0 and res["overhead_control_ratio"] > 0
    assert 0 < res["boundary_cost_us"] < res["overhead_loop_iteration_us"]
