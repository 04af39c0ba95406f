"""antman bench models: the step-memory trace, the workload model it is compared with, and the worker
machinery (run for real on the CPU; the GPU run carries the ``gpu`` marker)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from slurm_antman import bench_models as bm
from slurm_antman.evaluation.memory_trace import ALLOCATOR_GRANULE, trace_step


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
    from slurm_antman.evaluation.published import pair_slowdowns

    assert bm.model_slowdown("resnet50", "transformer_nmt") == pytest.approx(pair_slowdowns()[("R50_32", "T64")])
    assert bm.model_slowdown("transformer_nmt", "resnet50") == pytest.approx(pair_slowdowns()[("T64", "R50_32")])


def test_unknown_profile_is_a_clear_error():
    p = subprocess.run([sys.executable, "-m", "slurm_antman.bench_models", "--profiles", "resnet50,nope"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "--profiles nope: unknown; allowed:" in p.stderr and "resnet50" in p.stderr


def test_pairs_need_a_device_that_takes_time():
    p = subprocess.run([sys.executable, "-m", "slurm_antman.bench_models", "--device", "meta",
                        "--profiles", "lstm_lm", "--pairs-with", "lstm_lm"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "--pairs-with needs --device cuda" in p.stderr


def test_cpu_workers_run_alone_and_in_pairs(tmp_path):
    """The GPU run's machinery for real on the CPU: separate worker processes, a shared start, the
    solo and paired mini-batch times and the slowdowns computed from them."""
    out = tmp_path / "models.json"
    p = subprocess.run([sys.executable, "-m", "slurm_antman.bench_models", "--device", "cpu",
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
    for who in "ab":
        assert pair[f"slowdown_{who}"] == pytest.approx(pair[f"iter_ms_{who}"] / row["solo"]["iter_ms"])
        assert math.isfinite(pair[f"slowdown_{who}"]) and pair[f"slowdown_{who}"] > 0
        assert pair[f"model_slowdown_{who}"] == pytest.approx(bm.model_slowdown("rl_ppo_atari", "rl_ppo_atari"))
    assert "rl_ppo_atari" in p.stdout  # the table


@pytest.mark.gpu
def test_gpu_models_measured_against_the_workload_model(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    out = tmp_path / "models.json"
    p = subprocess.run([sys.executable, "-m", "slurm_antman.bench_models", "--device", "cuda",
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
