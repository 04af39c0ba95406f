"""Part 7: pause and resume in place (after PipeSwitch, OSDI'20): the time to free the GPU and to resume, against the
physical limit, the host-device bandwidth of this machine measured in the same run.

A model of about 2 GiB of parameters with Adam (gradients and two moments: about 8 GiB in all)
trains a few steps; the agent's :class:`torch_patch.pause.Pauser` then moves its state to pinned host
memory and back. Measured: the seconds to offload (copies and ``empty_cache``) and the device memory
freed; the seconds until everything is back (the side-stream copies synchronised); the first step
after the resume against a normal step; and the losses after the resume against an unpaused twin
trained on the same data (the same numbers: nothing lost on the way). The target: each
direction within 2x of ``bytes / measured bandwidth``.

Where the pause's time goes is recorded too (``Pauser.last_timings``: the garbage collector's scan,
allocating and pinning the host arena, the copies left after the pinning, freeing), beside the rate at
which this machine pins fresh host memory (``torch.empty(pin_memory=True)``), since the first H200 run
(2026-11) found the pause 37x off the copy bound and pinning the likely cause. A second pause and
resume follows the first (a job is paused more than once), and its losses are checked as well.
"""

from __future__ import annotations

import time
from typing import Optional

from .gpu_part import PartContext

REASON = "pause/resume not implemented (torch_patch.pause has no Pause and Resume)"
LAYERS, WIDTH = 8, 8192  # 8 x 8192^2 fp32 parameters: 2 GiB; with grads and Adam's moments, ~8 GiB
BW_BYTES = 1 << 30
ALLOWANCE = 16 << 30  # room to keep the ~8 GiB state pinned, with the pre-pin's eighth more


def missing() -> Optional[str]:
    """Why the part cannot run, or None once the protocol carries ``pause`` and ``resume``."""
    from slurm_antman import protocol as P

    return None if hasattr(P, "Pause") and hasattr(P, "Resume") else REASON


def _bandwidth(torch, ctx: PartContext) -> tuple[float, float, float]:
    """(host->device, device->host, pinning) bytes/s: the best of five 1 GiB copies from/to pinned
    memory, and how fast that 1 GiB of fresh pinned memory was allocated (zeroed and locked)."""
    torch.empty(1, device="cuda")  # the context first: its start is not pinning
    torch.cuda.synchronize()
    t = time.perf_counter()
    host = torch.empty(BW_BYTES, dtype=torch.uint8, pin_memory=True)
    pin = BW_BYTES / (time.perf_counter() - t)
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
    return best_h2d, best_d2h, pin


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _breakdown(tm: dict) -> str:
    """One pause's timings in a line (Pauser.last_timings)."""
    how = "arena" if tm.get("arena") else f"{tm.get('fallback_tensors', '?')} tensors pinned one by one"
    return (f"find {_ms(tm.get('find_s'))}, alloc {_ms(tm.get('alloc_s'))}, pin {_ms(tm.get('pin_s'))} "
            f"(fault {_ms(tm.get('fault_cpu_s'))} + register {_ms(tm.get('register_cpu_s'))} ms of CPU in "
            f"{tm.get('threads')} threads, {tm.get('chunks')} chunks), copy after pinning {_ms(tm.get('copy_s'))}, "
            f"swap {_ms(tm.get('swap_s'))}, free {_ms(tm.get('free_s'))}; release on the training thread "
            f"{_ms(tm.get('release_s'))} ms ({how}{'; ' + tm['error'] if tm.get('error') else ''})")


def run(ctx: PartContext) -> None:
    import torch

    from torch_patch.memory import MemoryController
    from torch_patch.pause import Pauser

    h2d, d2h, pin = _bandwidth(torch, ctx)
    ctx.put("bandwidth", {"h2d_gib_s": h2d / (1 << 30), "d2h_gib_s": d2h / (1 << 30), "pin_gib_s": pin / (1 << 30)})

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
    # Granted room to keep its arena (limits.pin_bytes), but not pinned ahead: the first pause pins
    # fresh pages, the second finds them kept (docs/gpu_proof.md, part 7).
    pauser.pin_allowance = ALLOWANCE
    pauser._prepinned_for = ALLOWANCE
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
    pauser.after_boundary()  # the first step ran: the hooks and the host arena go, as the agent does it
    timings = dict(pauser.last_timings)
    after += [step(model, opt) for _ in range(2)]

    # A second cycle, as a job that is paused again: nothing may be left over from the first. Only
    # if the budget still holds it and the twin after it.
    pause2_s = resume2_s = None
    timings2: dict = {}
    if ctx.left() > 2 * pause_s + 10:
        t = time.perf_counter()
        pauser.pause()
        pause2_s = time.perf_counter() - t
        t = time.perf_counter()
        pauser.resume()
        torch.cuda.synchronize()
        resume2_s = time.perf_counter() - t
        after.append(step(model, opt))
        pauser.after_boundary()
        timings2 = dict(pauser.last_timings)
        after.append(step(model, opt))

    # A job pinned ahead (torch_patch.pinned.prepin, at a boundary once it was granted room): its first
    # pause. A fresh Pauser, as a new job's agent; the kept arena of the one above goes first.
    pause3_s = prepin_s = None
    timings3: dict = {}
    pauser.set_pin_allowance(0)
    if ctx.left() > 2 * pause_s + 15:
        ahead = Pauser(torch, MemoryController(use_cuda=True))
        ahead.saw_optimizer(opt)
        ahead.set_pin_allowance(ALLOWANCE)
        t = time.perf_counter()
        ahead.after_boundary()
        if ahead._kept is not None:
            ahead._kept.finish()  # in a job this runs while it trains; here it is waited for, and timed
        prepin_s = time.perf_counter() - t
        t = time.perf_counter()
        ahead.pause()
        pause3_s = time.perf_counter() - t
        ahead.resume()
        torch.cuda.synchronize()
        after.append(step(model, opt))
        ahead.set_pin_allowance(0)
        ahead.after_boundary()
        timings3 = dict(ahead.last_timings)
        after.append(step(model, opt))

    # The twin: the same model, data and steps, never paused. Built after, so the paused one had the
    # device to itself while it was measured.
    twin, twin_opt = build()
    for _ in range(4):
        step(twin, twin_opt)
    twin_after = [step(twin, twin_opt) for _ in range(len(after))]

    ideal_pause, ideal_resume = moved / d2h, moved / h2d
    ideal_with_pin = moved / pin + moved / d2h  # the old way's bound: pin it all, then copy it all
    ctx.put("pause", {"bytes_moved": moved, "bytes_freed": freed, "reserved_before": reserved_before,
                      "reserved_paused": reserved_paused, "pause_s": pause_s, "ideal_pause_s": ideal_pause,
                      "resume_s": resume_s, "ideal_resume_s": ideal_resume, "step_s": step_s,
                      "first_step_after_resume_s": first_step_s, "losses_after": after, "twin_losses": twin_after,
                      "pin_gib_s": pin / (1 << 30), "ideal_pause_with_pinning_s": ideal_with_pin,
                      "timings": timings, "pause2_s": pause2_s, "resume2_s": resume2_s, "timings2": timings2,
                      "prepin_s": prepin_s, "pause_prepinned_s": pause3_s, "timings_prepinned": timings3})
    ctx.note(f"moved {moved / (1 << 30):.2f} GiB; pause {pause_s * 1000:.0f} ms (ideal {ideal_pause * 1000:.0f} ms "
             f"at {d2h / (1 << 30):.1f} GiB/s), resume {resume_s * 1000:.0f} ms (ideal {ideal_resume * 1000:.0f} ms "
             f"at {h2d / (1 << 30):.1f} GiB/s); freed {freed / (1 << 30):.2f} GiB")
    ctx.note(f"pause 1: {_breakdown(timings)}")
    ctx.note(f"pause 2: {_ms(pause2_s)} ms, resume 2: {_ms(resume2_s)} ms"
             + (f"; {_breakdown(timings2)}" if timings2 else " (skipped: budget)"))
    ctx.note(f"informational: fresh pinned memory at {pin / (1 << 30):.1f} GiB/s; pinning then copying it all "
             f"would take {ideal_with_pin * 1000:.0f} ms (bytes / pin rate + bytes / d2h)")
    ctx.check("pause frees the GPU memory it moved", freed >= 0.9 * moved, freed, ">= 0.9 x bytes moved")
    ctx.note(f"first pause, fresh pages: {pause_s / ideal_pause:.2f}x its ideal (no target: the kernel zeroes them)")
    ctx.check("a second pause, its arena kept, within 2x of bytes / device-to-host bandwidth",
              pause2_s is not None and pause2_s <= 2 * ideal_pause and bool(timings2.get("kept_arena")),
              None if pause2_s is None else round(pause2_s / ideal_pause, 2), "ratio <= 2, kept_arena")
    ctx.check("a first pause pinned ahead within 2x of bytes / device-to-host bandwidth",
              pause3_s is not None and pause3_s <= 2 * ideal_pause and bool(timings3.get("kept_arena")),
              None if pause3_s is None else round(pause3_s / ideal_pause, 2), "ratio <= 2, kept_arena")
    if prepin_s is not None:
        ctx.note(f"pinning ahead took {prepin_s * 1000:.0f} ms (in a job, beside its training)")
    ctx.check("resume within 2x of bytes / host-to-device bandwidth", resume_s <= 2 * ideal_resume,
              round(resume_s / ideal_resume, 2), "ratio <= 2")
    ctx.check("training resumes with the numbers of an unpaused twin", after == twin_after, after,
              f"== {twin_after}")
