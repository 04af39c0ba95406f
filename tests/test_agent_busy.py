"""GPU busy time from CUDA events (torch_patch/busy.py): a data-loader stall is not busy time.

On the first GPU run the host clock reported a job stalling half of each iteration as 100 % busy.
Here a GPU-bound loop runs with and without a stall as long as its own work; the events must see
the difference that NVML sees."""

from __future__ import annotations

import time

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is false)")


def _busy_fraction(stall_s: float, iters: int = 30) -> float:
    from torch_patch.busy import GpuBusy

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(512, 4096, device="cuda")
    gb = GpuBusy(torch, torch.device("cuda", torch.cuda.current_device()))
    assert gb.attach() >= 1
    try:
        busy = wall = 0.0
        for i in range(iters):
            t = time.perf_counter()
            if stall_s:
                torch.cuda.synchronize()  # the loader's wait starts once the GPU is done, as it is for a real stall
                time.sleep(stall_s)
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
            gb.boundary()
            torch.cuda.synchronize()
            if i >= 5:
                wall += time.perf_counter() - t
        torch.cuda.synchronize()
        s, n = gb.collect()
        assert n >= iters - 1
        busy = s * (iters - 5) / n
        return busy / wall
    finally:
        gb.detach()


@pytest.mark.gpu
@needs_cuda
def test_events_count_the_gpu_work_and_not_the_stall():
    t = time.perf_counter()
    full = _busy_fraction(0.0, iters=10)
    one = (time.perf_counter() - t) / 10
    stalled = _busy_fraction(one)
    assert full >= 0.8
    assert stalled <= 0.7 and stalled <= full - 0.2
