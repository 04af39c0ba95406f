"""antman bench models: the step-memory trace, the workload model it is compared with, and the worker
machinery (run for real on the CPU; the GPU run carries the ``gpu`` marker)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Optional

import pytest
import torch

from slurm_antman.lab.bench import models as bm
from slurm_antman.lab.evaluation.memory_trace import ALLOCATOR_GRANULE, trace_step


def _r(n: int) -> int:
    return -(-n // ALLOCATOR_GRANULE) * ALLOCATOR_GRANULE


def _mlp(device: str):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.ReLU(), torch.nn.Linear(1000, 10)).to(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(64, 1000, device=device)
    y = torch.randint(0, 10, (64,), device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()

    return m, (x, y), step


def test_steady_state_is_weights_grads_momentum_and_batch_exactly():
    m, inputs, step = _mlp("meta")
    mem = trace_step(m, inputs, step)
    weights = _r(1000 * 1000 * 4) + _r(1000 * 4) + _r(10 * 1000 * 4) + _r(10 * 4)
    batch = _r(64 * 1000 * 4) + _r(64 * 8)
    assert mem.weights_bytes == weights
    # After a step: weights, their gradients and SGD's momentum buffers (one each), and the batch.
    assert mem.steady_bytes == 3 * weights + batch
    # The worst moment also holds activations (64x1000 floats at least) on top of that.
    assert mem.steady_bytes + _r(64 * 1000 * 4) <= mem.peak_bytes < mem.steady_bytes + 8 * _r(64 * 1000 * 4)


def test_meta_trace_matches_a_real_cpu_run():
    """Meta tensors allocate nothing; the count must still be what a real run holds."""
    got = {dev: trace_step(*_mlp(dev)) for dev in ("meta", "cpu")}
    assert got["meta"] == got["cpu"]


def test_temporaries_count_at_their_peak_only_and_views_are_free():
    w = torch.nn.Parameter(torch.zeros(256, device="meta"))
    model = torch.nn.Module()
    model.w = w

    def step() -> None:
        big = torch.ones(1 << 20, device="meta")       # 4 MiB temporary
        v = big.view(1024, 1024).t()                     # views: no new storage
        del big, v

    mem = trace_step(model, [], step)
    assert mem.weights_bytes == _r(256 * 4)
    assert mem.peak_bytes == mem.weights_bytes + (4 << 20)
    assert mem.steady_bytes == mem.weights_bytes


def test_warmup_must_create_optimizer_state():
    m, inputs, step = _mlp("meta")
    with pytest.raises(ValueError, match="warmup_steps"):
        trace_step(m, inputs, step, warmup_steps=0)


def test_the_model_column_is_the_workload_models_measured_pair():
    from slurm_antman.lab.evaluation.published import pair_slowdowns

    assert bm.model_slowdown("resnet50", "transformer_nmt") == pytest.approx(pair_slowdowns()[("R50_32", "T64")])
    assert bm.model_slowdown("transformer_nmt", "resnet50") == pytest.approx(pair_slowdowns()[("T64", "R50_32")])


def test_unknown_profile_is_a_clear_error():
    p = subprocess.run([sys.executable, "-m", "slurm_antman.lab.bench.models", "--profiles", "resnet50,nope"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "--profiles nope: unknown; allowed:" in p.stderr and "resnet50" in p.stderr


def test_pairs_need_a_device_that_takes_time():
    p = subprocess.run([sys.executable, "-m", "slurm_antman.lab.bench.models", "--device", "meta",
                        "--profiles", "lstm_lm", "--pairs-with", "lstm_lm"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "--pairs-with needs --device cuda" in p.stderr


def test_cpu_workers_run_alone_and_in_pairs(tmp_path):
    """The GPU run's machinery for real on the CPU: separate worker processes, a shared start, the
    solo and paired mini-batch times and the slowdowns computed from them."""
    out = tmp_path / "models.json"
    p = subprocess.run([sys.executable, "-m", "slurm_antman.lab.bench.models", "--device", "cpu",
                        "--profiles", "rl_ppo_atari", "--pairs-with", "rl_ppo_atari", "--batch", "8",
                        "--window-s", "1.5", "--warmup", "1", "--threads", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    row = doc["profiles"]["rl_ppo_atari"]
    assert row["traced"]["batch"] == 8 and row["solo"]["batch"] == 8
    assert row["solo"]["steps"] >= 1 and row["solo"]["iter_ms"] > 0
    (pair,) = doc["pairs"]
    assert pair["a"] == pair["b"] == "rl_ppo_atari"
    assert doc["duties"] == [1.0] and pair["duty_a"] == pair["duty_b"] == 1.0
    for who in "ab":
        assert pair[f"slowdown_{who}"] == pytest.approx(pair[f"iter_ms_{who}"] / row["solo"]["iter_ms"])
        assert math.isfinite(pair[f"slowdown_{who}"]) and pair[f"slowdown_{who}"] > 0
        assert pair[f"model_slowdown_{who}"] == pytest.approx(bm.model_slowdown("rl_ppo_atari", "rl_ppo_atari"))
        # At full duty the formula is its own calibration, and Gavel's is the model column.
        assert pair[f"formula_slowdown_{who}"] == pytest.approx(pair[f"slowdown_{who}"])
        assert pair[f"formula_error_{who}"] == pytest.approx(0.0, abs=1e-12)
        assert pair[f"formula_gavel_slowdown_{who}"] == pytest.approx(pair[f"model_slowdown_{who}"])
    assert "rl_ppo_atari" in p.stdout  # the table


# --- the interference formula's check (--duties) ------------------------------------------------------


def test_prediction_is_the_measured_pair_at_full_duty_and_none_at_zero():
    for d in (0.93, 1.0, 1.8, 4.94):  # 0.93: a pair measured faster together (noise) stays as measured
        assert bm.predicted_slowdown(d, 1.0, 1.0) == d
        assert bm.predicted_slowdown(d, 0.0, 1.0) == bm.predicted_slowdown(d, 1.0, 0.0) == 1.0


def test_prediction_slows_the_victims_gpu_work_by_the_neighbours_active_time():
    d = 2.5
    for ba, bb in ((0.5, 0.5), (1.0, 0.5), (0.5, 1.0), (0.3, 0.8), (0.25, 0.25)):
        assert bm.predicted_slowdown(d, ba, bb) == pytest.approx(1.0 - ba + ba / (1.0 - bb + bb / d))
    # The H100's throttle curve (docs/benchmarks.md, runs 2 and 3): d = 2.19 at full share, measured
    # 1.386-1.400 at share 0.5 and 1.065-1.066 at 0.1, which the form meets within 0.03.
    assert bm.predicted_slowdown(2.19, 1.0, 1.0, share_neighbour=0.5) == pytest.approx(1.393, abs=0.03)
    assert bm.predicted_slowdown(2.19, 1.0, 1.0, share_neighbour=0.1) == pytest.approx(1.065, abs=0.03)


def test_prediction_is_the_workload_models_formula_with_gavels_pair_as_calibration():
    from slurm_antman.lab.evaluation import workloads
    from slurm_antman.lab.evaluation.published import pair_slowdowns

    for (vk, nk), d in pair_slowdowns().items():
        if d < 1.0:
            continue  # the workload model counts those as no interference; the check keeps the noise
        for bv, bn in ((1.0, 1.0), (0.5, 0.5), (0.2, 0.9)):
            assert bm.predicted_slowdown(d, bv, bn) == pytest.approx(workloads.pair_slowdown(vk, nk, bv, bn))


def test_stall_keeps_the_job_busy_its_duty_of_the_time():
    assert bm.stall_ms(100.0, 1.0) == 0.0
    assert bm.stall_ms(100.0, 0.5) == pytest.approx(100.0)
    assert bm.stall_ms(100.0, 0.25) == pytest.approx(300.0)
    for duty in (0.1, 0.4, 0.9):
        assert 100.0 / (100.0 + bm.stall_ms(100.0, duty)) == pytest.approx(duty)


def test_duty_is_nvmls_utilisation_ratio_or_the_nominal_one_without_nvml():
    full = {"util": 0.9, "iter_ms": 100.0, "busy_ms": 100.0}
    assert bm.measured_duty(0.5, {"util": 0.36}, full) == (pytest.approx(0.4), "nvml")
    assert bm.measured_duty(1.0, full, full) == (1.0, "nvml")
    assert bm.measured_duty(0.5, {"util": 0.95}, full) == (1.0, "nvml")  # never above full duty
    for at, f in (({}, {}), ({"util": 0.4}, {}), ({"util": float("nan")}, full), ({"util": 0.4}, {"util": 0.0})):
        assert bm.measured_duty(0.5, at, f) == (0.5, "nominal")  # --device cpu: no NVML fields
    assert bm.time_duty({"iter_ms": 210.0, "busy_ms": 105.0}, full) == pytest.approx(0.5)


def test_duty_combinations_calibrate_first_and_skip_mirrors_of_a_self_pair():
    assert bm.duty_combinations([1.0, 0.5], same=False) == [(1.0, 1.0), (1.0, 0.5), (0.5, 1.0), (0.5, 0.5)]
    assert bm.duty_combinations([1.0, 0.5], same=True) == [(1.0, 1.0), (1.0, 0.5), (0.5, 0.5)]
    assert bm.duty_combinations([1.0], same=False) == [(1.0, 1.0)]


def _solo_record(duty: float, iter_ms: float, util: Optional[float] = None) -> dict:
    """A solo record as ``_solo`` keeps it: 100 ms busy per step, at full duty util 0.9 (or no NVML)."""
    nvml = {} if util is None else {"util": util}
    full = bm._with_duty({"iter_ms": 100.0, "busy_ms": 100.0, **({} if util is None else {"util": 0.9})}, 1.0, None)
    return full if duty == 1.0 else bm._with_duty({"iter_ms": iter_ms, "busy_ms": 100.0, **nvml}, duty, full)


def test_pair_entry_checks_the_formula_against_the_whole_minibatch():
    from slurm_antman.lab.evaluation import workloads

    a, b = "resnet50", "lstm_lm"
    full_a = full_b = _solo_record(1.0, 100.0, util=0.9)
    full = bm.pair_entry(a, b, {"iter_ms": 180.0}, {"iter_ms": 150.0}, full_a, full_b)
    assert (full["slowdown_a"], full["slowdown_b"]) == (pytest.approx(1.8), pytest.approx(1.5))
    assert full["formula_slowdown_a"] == full["slowdown_a"] and full["formula_error_a"] == 0.0
    assert full["formula_gavel_slowdown_a"] == pytest.approx(bm.model_slowdown(a, b))
    # At duty 0.5 by NVML (0.45 of 0.9) each side's mini-batch is 100 ms busy + 100 ms stall alone;
    # beside the other it takes 230 ms: slowdown 1.15 of the whole mini-batch, idle time included.
    half_a, half_b = _solo_record(0.5, 200.0, util=0.45), _solo_record(0.5, 200.0, util=0.45)
    assert half_a["formula_duty"] == pytest.approx(0.5) and half_a["duty_source"] == "nvml"
    q = bm.pair_entry(a, b, {"iter_ms": 230.0}, {"iter_ms": 210.0}, half_a, half_b, full)
    assert (q["duty_a"], q["duty_b"]) == (0.5, 0.5)
    assert q["slowdown_a"] == pytest.approx(1.15) and q["slowdown_b"] == pytest.approx(1.05)
    # 1 - b_a + b_a / (1 - b_b + b_b / d_ab): 0.5 + 0.5 / (0.5 + 0.5 / 1.8) = 1.1429
    assert q["formula_slowdown_a"] == pytest.approx(0.5 + 0.5 / (0.5 + 0.5 / 1.8))
    assert q["formula_slowdown_b"] == pytest.approx(0.5 + 0.5 / (0.5 + 0.5 / 1.5))
    assert q["formula_error_a"] == pytest.approx(abs(1.15 - q["formula_slowdown_a"]))
    assert q["formula_error_b"] == pytest.approx(abs(1.05 - q["formula_slowdown_b"]))
    kind_a, kind_b = workloads.BY_NAME[a].kind, workloads.BY_NAME[b].kind
    assert q["formula_gavel_slowdown_a"] == pytest.approx(workloads.pair_slowdown(kind_a, kind_b, 0.5, 0.5))
    assert q["formula_gavel_slowdown_b"] == pytest.approx(workloads.pair_slowdown(kind_b, kind_a, 0.5, 0.5))
    assert q["model_slowdown_a"] == full["model_slowdown_a"]  # the uncontrolled pair, as before
    # Without NVML the nominal duties go in.
    cpu = bm.pair_entry(a, b, {"iter_ms": 230.0}, {"iter_ms": 210.0}, _solo_record(0.5, 200.0),
                        _solo_record(1.0, 100.0), full)
    assert cpu["formula_slowdown_a"] == pytest.approx(1 + 0.5 * 0.8)
    assert "slowdown 1.15 / 1.05, formula 1.14 / 1.10" in bm.table({"profiles": {}, "pairs": [q]})


@pytest.mark.parametrize("bad", ["0", "1.5", "x", "1.0,", "-0.5", "nan"])
def test_bad_duties_are_a_clear_error(bad):
    with pytest.raises(bm.BenchModelsError, match=r"--duties .*: each duty must be a number in \(0, 1\]"):
        bm.parse_duties(bad)


def test_duties_always_include_the_full_duty_calibration():
    assert bm.parse_duties(None) == bm.parse_duties("1.0") == [1.0]
    assert bm.parse_duties("0.5") == bm.parse_duties(" 0.5, 1 ,0.5") == [1.0, 0.5]


def test_duties_errors_on_the_command_line(capsys):
    assert bm.main(["--device", "meta", "--profiles", "lstm_lm", "--duties", "1.5"]) == 2
    assert "--duties '1.5': each duty must be a number in (0, 1]" in capsys.readouterr().err
    assert bm.main(["--device", "meta", "--profiles", "lstm_lm", "--duties", "0.5"]) == 2
    assert "--duties needs --device cuda" in capsys.readouterr().err


def test_cpu_stall_gives_the_duty(tmp_path):
    """The stall for real in a CPU worker: at duty 0.5 the worker sleeps as long as it computes."""
    a = bm._parser().parse_args(["--device", "cpu", "--profiles", "rl_ppo_atari", "--batch", "8",
                                 "--duties", "1.0,0.5", "--window-s", "2", "--warmup", "1", "--threads", "1"])
    doc = bm.measure(a, log=lambda s: None)
    row = doc["profiles"]["rl_ppo_atari"]
    full, half = row["solo"], row["solo_at_duty"]["0.5"]
    assert half["stall_ms"] == pytest.approx(full["iter_ms"])
    # The sleep itself: its mean over the steps is the stall asked for (drawn from [0, 2x] per step).
    assert 0.6 < (half["iter_ms"] - half["busy_ms"]) / half["stall_ms"] < 1.4
    # Busy half the time, loosely: a shared 2-core machine moves the compute time between runs.
    assert 0.35 < half["duty_time"] < 0.75
    assert half["formula_duty"] == 0.5 and half["duty_source"] == "nominal"  # no NVML on the CPU
    assert full["duty_time"] == 1.0 and full["formula_duty"] == 1.0


@pytest.mark.gpu
def test_gpu_formula_predicts_pairs_at_half_duty(tmp_path):
    """The interference formula of evaluation.workloads against a GPU: resnet50 beside lstm_lm at
    duties 1.0 and 0.5, the formula calibrated with the same run's full-duty pair."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    out = tmp_path / "duties.json"
    p = subprocess.run([sys.executable, "-m", "slurm_antman.lab.bench.models", "--device", "cuda",
                        "--profiles", "resnet50", "--pairs-with", "lstm_lm", "--duties", "1.0,0.5",
                        "--window-s", "5", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    for name in ("resnet50", "lstm_lm"):
        half = doc["profiles"][name]["solo_at_duty"]["0.5"]
        assert half["duty_source"] == "nvml" and 0.3 < half["formula_duty"] < 0.8, half
    by_duty = {(q["duty_a"], q["duty_b"]): q for q in doc["pairs"]}
    assert set(by_duty) == {(1.0, 1.0), (1.0, 0.5), (0.5, 1.0), (0.5, 0.5)}
    q = by_duty[(0.5, 0.5)]
    assert q["formula_error_a"] < 0.35 and q["formula_error_b"] < 0.35, bm.table(doc)


@pytest.mark.gpu
def test_gpu_models_measured_against_the_workload_model(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    out = tmp_path / "models.json"
    p = subprocess.run([sys.executable, "-m", "slurm_antman.lab.bench.models", "--device", "cuda",
                        "--profiles", "resnet50,lstm_lm", "--pairs-with", "resnet50", "--window-s", "5",
                        "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    for name in ("resnet50", "lstm_lm"):
        solo = doc["profiles"][name]["solo"]
        traced = doc["profiles"][name]["traced"]
        # The meta trace counts what torch.cuda's allocator counts, give or take cuDNN workspaces.
        assert 0.7 < solo["max_allocated_bytes"] / traced["peak_bytes"] < 1.5
        assert solo["nvml_process_mem_bytes"] >= solo["max_reserved_bytes"]
        assert 0 < solo["util"] <= 1
    for q in doc["pairs"]:
        assert q["slowdown_a"] > 1.0 and q["slowdown_b"] > 1.0  # two uncontrolled jobs slow each other
