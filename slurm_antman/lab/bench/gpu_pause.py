"""Part 7: pause and resume in place (issue 16): the time to free the GPU and to resume, against the
physical limit, the host-device bandwidth of this machine measured in the same run.

A model of about 2 GiB of parameters with Adam (gradients and two moments: about 8 GiB in all)
trains a few steps; the agent's :class:`torch_patch.pause.Pauser` then moves its state to pinned host
memory and back. Measured: the seconds to offload (copies and ``empty_cache``) and the device memory
freed; the seconds until everything is back (the side-stream copies synchronised); the first step
after the resume against a normal step; and the losses after the resume against an unpaused twin
trained on the same data (the same numbers: nothing lost on the way). The issue's target: each
direction within 2x of ``bytes / measured bandwidth``.
"""

from __future__ import annotations

import time
from typing import Optional

from .gpu_part import PartContext

REASON = "pause/resume not implemented (issue 16)"
LAYERS, WIDTH = 8, 8192  # 8 x 8192^2 fp32 parameters: 2 GiB; with grads and Adam's moments, ~8 GiB
BW_BYTES = 1 << 30


def missing() -> Optional[str]:
    """Why the part cannot run, or None once the protocol carries ``pause`` and ``resume``."""
    from slurm_antman import protocol as P

    return None if hasattr(P, "Pause") and hasattr(P, "Resume") else REASON


def _bandwidth(torch, ctx: PartContext) -> tuple[float, float]:
    """(host->device, device->host) bytes/s: the best of five 1 GiB copies from/to pinned memory."""
    host = torch.empty(BW_BYTES, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(BW_BYTES, dtype=torch.uint8, device="cuda")
    best_h2d = best_d2h = 0.0
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best_h2d = max(best_h2d, BW_BYTES / (start.elapsed_time(end) / 1000.0))
        start.record()
        host.copy_(dev, non_blocking=True)
        end.record()
        end.synchronize()
        best_d2h = max(best_d2h, BW_BYTES / (start.elapsed_time(end) / 1000.0))
    del host, dev
    torch.cuda.empty_cache()
    return best_h2d, best_d2h


def run(ctx: PartContext) -> None:
    import torch

    from torch_patch.memory import MemoryController
    from torch_patch.pause import Pauser

    h2d, d2h = _bandwidth(torch, ctx)
    ctx.put("bandwidth", {"h2d_gib_s": h2d / (1 << 30), "d2h_gib_s": d2h / (1 << 30)})

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)]).cuda()
        return m, torch.optim.Adam(m.parameters(), lr=1e-4)

    x = torch.randn(64, WIDTH, device="cuda")

    def step(m, o) -> float:
        o.zero_grad(set_to_none=False)
        loss = m(x).square().mean()
        loss.backward()
        o.step()
        return loss.item()

    model, opt = build()
    for _ in range(3):
        step(model, opt)
    torch.cuda.synchronize()
    t = time.perf_counter()
    step(model, opt)
    torch.cuda.synchronize()
    step_s = time.perf_counter() - t
    pauser = Pauser(torch, MemoryController(use_cuda=True))
    pauser.saw_optimizer(opt)
    reserved_before = torch.cuda.memory_reserved()

    t = time.perf_counter()
    freed, moved = pauser.pause()
    pause_s = time.perf_counter() - t
    reserved_paused = torch.cuda.memory_reserved()
    t = time.perf_counter()
    pauser.resume()
    torch.cuda.synchronize()
    resume_s = time.perf_counter() - t
    t = time.perf_counter()
    after = [step(model, opt)]
    torch.cuda.synchronize()
    first_step_s = time.perf_counter() - t
    pauser.after_boundary()  # the first step ran: the restore's hooks go, as the agent does it
    after += [step(model, opt) for _ in range(2)]

    # The twin: the same model, data and steps, never paused. Built after, so the paused one had the
    # device to itself while it was measured.
    twin, twin_opt = build()
    for _ in range(4):
        step(twin, twin_opt)
    twin_after = [step(twin, twin_opt) for _ in range(3)]

    ideal_pause, ideal_resume = moved / d2h, moved / h2d
    ctx.put("pause", {"bytes_moved": moved, "bytes_freed": freed, "reserved_before": reserved_before,
                      "reserved_paused": reserved_paused, "pause_s": pause_s, "ideal_pause_s": ideal_pause,
                      "resume_s": resume_s, "ideal_resume_s": ideal_resume, "step_s": step_s,
                      "first_step_after_resume_s": first_step_s, "losses_after": after, "twin_losses": twin_after})
    ctx.note(f"moved {moved / (1 << 30):.2f} GiB; pause {pause_s * 1000:.0f} ms (ideal {ideal_pause * 1000:.0f} ms "
             f"at {d2h / (1 << 30):.1f} GiB/s), resume {resume_s * 1000:.0f} ms (ideal {ideal_resume * 1000:.0f} ms "
             f"at {h2d / (1 << 30):.1f} GiB/s); freed {freed / (1 << 30):.2f} GiB")
    ctx.check("pause frees the GPU memory it moved", freed >= 0.9 * moved, freed, ">= 0.9 x bytes moved")
    ctx.check("pause within 2x of bytes / device-to-host bandwidth", pause_s <= 2 * ideal_pause,
              round(pause_s / ideal_pause, 2), "ratio <= 2")
    ctx.check("resume within 2x of bytes / host-to-device bandwidth", resume_s <= 2 * ideal_resume,
              round(resume_s / ideal_resume, 2), "ratio <= 2")
    ctx.check("training resumes with the numbers of an unpaused twin", after == twin_after, after,
              f"== {twin_after}")
