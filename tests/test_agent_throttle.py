"""The agent's compute throttle, with real PyTorch training loops on CPU."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from torch.nn.modules import module as nn_module

import torch_patch
from torch_patch.agent import Agent
from torch_patch.throttle import Throttle, ThrottleError


def _job(width: int = 256, depth: int = 4, batch: int = 64):
    torch.manual_seed(0)
    layers: list = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, width), torch.randn(batch, 1)

    def iteration() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    return iteration


@pytest.fixture(autouse=True)
def _one_thread():
    torch_patch.uninstall()
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _timed(fn, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - t


def test_bad_share_is_rejected_with_the_allowed_range():
    th = Throttle()
    for bad in (0, -0.5, 1.5, "half", True, float("nan")):
        with pytest.raises(ThrottleError, match=r"compute share must be"):
            th.set_share(bad)
    with pytest.raises(ThrottleError, match="launch, iteration, off"):
        Throttle(mode="sometimes")


def test_share_one_installs_no_hooks_at_all():
    before_pre = len(nn_module._global_forward_pre_hooks)
    before_post = len(nn_module._global_forward_hooks)
    th = Throttle(mode="launch")
    th.set_share(1.0)
    assert len(nn_module._global_forward_pre_hooks) == before_pre
    assert len(nn_module._global_forward_hooks) == before_post
    th.set_share(0.5)
    assert len(nn_module._global_forward_pre_hooks) == before_pre + 1
    assert len(nn_module._global_forward_hooks) == before_post + 1
    th.set_share(1.0)
    assert len(nn_module._global_forward_pre_hooks) == before_pre
    assert len(nn_module._global_forward_hooks) == before_post
    th.close()


class _CountingSleep:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, s: float) -> None:
        self.calls += 1
        time.sleep(s)


@pytest.mark.parametrize("mode,spread", [("launch", True), ("iteration", False)])
def test_launch_mode_spreads_idle_time_inside_the_iteration(mode: str, spread: bool):
    sleep = _CountingSleep()
    th = Throttle(mode=mode, sleep=sleep)
    it = _job()
    th.set_share(0.25)  # no reference yet: idle follows the measured busy time
    try:
        for _ in range(3):
            it()
            th.end_iteration()
    finally:
        th.close()
    per_iteration = sleep.calls / 3
    if spread:
        assert per_iteration > 2, "launch mode should idle between operations, not once per step"
    else:
        assert per_iteration == 1
    assert th.duty_cycle() == pytest.approx(0.25, abs=0.05)


@pytest.mark.parametrize("mode", ["launch", "iteration"])
def test_share_half_gives_half_the_unthrottled_speed(mode: str):
    """Duty cycle = unthrottled iteration time / throttled one, measured side by side."""
    agent = Agent(job_id=None, job_class="opportunistic", throttle_mode=mode, use_cuda=False).start()
    try:
        it = _job()
        for _ in range(5):
            it()
        ratios = []
        for _ in range(5):
            # The agent applies shares at iteration boundaries; this test is the training thread.
            agent.throttle.set_share(1.0)
            base = _timed(it, 10)
            agent.throttle.set_share(0.5)
            throttled = _timed(it, 10)
            ratios.append(base / throttled)
        duty = statistics.median(ratios)
        assert abs(duty - 0.5) <= 0.05, f"duty cycle {duty:.3f} (rounds {ratios})"
        assert agent.iteration >= 105
    finally:
        agent.stop()


class _FakeTime:
    """A clock and a sleep that only move when told: the throttle's arithmetic, exactly."""

    def __init__(self) -> None:
        self.t = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def test_a_new_share_retunes_the_idle_owed_at_the_next_hook():
    ft = _FakeTime()
    th = Throttle(clock=ft.clock, sleep=ft.sleep, quantum_s=1e9)  # nothing paid inside: count the debt
    try:
        th.set_share(0.01)
        ft.t += 0.1
        th.tick()
        assert th._debt == pytest.approx(0.1 * 99)
        th.retune("0.5")         # not a share: ignored, as the protocol's validation would have
        th.retune(0.0)
        ft.t += 0.1
        th.tick()
        assert th.share == 0.01 and th._debt == pytest.approx(0.2 * 99)
        th.retune(0.5)           # a raise: the next hook owes what 0.5 would have
        ft.t += 0.1
        th.tick()
        assert th.share == 0.5 and th._debt == pytest.approx(0.3 * 1.0)
        th.retune(0.1)           # a cut alike, at once, not an iteration late
        ft.t += 0.1
        th.tick()
        assert th.share == 0.1 and th._debt == pytest.approx(0.3 * 9 + 0.1 * 9)
        # The boundary's share is the sidecar's word: a stale retune never outlives it.
        th.retune(0.8)
        th.set_share(0.25)
        ft.t += 0.1
        th.tick()
        assert th.share == 0.25
    finally:
        th.close()
