"""Part 2: host spill (``torch_patch.spill.HostSpill``) keeps an opportunistic job training under a
memory limit below its footprint.

Two runs of zoo ResNet-50 from the same seed and the same synthetic batch, in this process: first
unlimited (the reference: its losses, its mini-batch time, its footprint), then under the real agent as
an opportunistic job, whose memory controller has the spill pool. The second run's first step is
unlimited, as a running job's is before a guaranteed job claims its memory; then the limit comes, at
``LIMIT_FRACTION`` of the reference's footprint. What does not fit goes to pinned, mapped host memory.
"Spilled" is sampled at the end of each forward pass, when the activations are all alive.

Losses: cuDNN is put in deterministic mode for both runs, so the same kernels see the same numbers; the
comparison is within ``LOSS_RTOL`` (relative, per step), and whether the runs agree bit for bit is
recorded too. GPU memory: NVML's figure for this process, sampled all along the spilled run, must stay
under the limit plus what the process holds outside torch's allocator (CUDA context, cuDNN/cuBLAS
handles), measured just before the spilled run, plus ``NVML_SLACK_BYTES``.
"""

from __future__ import annotations

import gc
import os
import time

from .gpu_part import PartContext, rel_diff

MiB = 1 << 20
MODEL, BATCH = "resnet50", 32
LIMIT_FRACTION = 0.5
STEPS = 12
# fp32 training with deterministic kernels: equal losses unless the kernels differ (a cuDNN algorithm
# chosen for a different workspace); 1e-3 relative over 12 steps allows that and nothing larger.
LOSS_RTOL = 1e-3
# NVML rounds process memory to its own granularity (2 MiB pages on recent drivers) and the driver
# may map a little more on demand; 64 MiB is far below a spilled model's size.
NVML_SLACK_BYTES = 64 * MiB


def _train(loop, steps: int, deadline: float, spill=None) -> dict:
    import torch

    losses, times, spilled = [], [], [0]
    hook = None
    if spill is not None:
        def sample(*_args) -> None:
            spilled[0] = max(spilled[0], spill.in_use_bytes())
        hook = loop.model.register_forward_hook(sample)
    try:
        _steps(loop, steps, deadline, losses, times)
    finally:
        if hook is not None:
            hook.remove()
    # The first steps include cuDNN's set-up and, spilled, the pool's first segments: not steady state.
    steady = times[2:] or times
    return {"losses": losses, "step_ms": sum(steady) / len(steady) * 1000.0, "steps": len(losses),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(), "spilled_peak_bytes": spilled[0]}


def _steps(loop, steps: int, deadline: float, losses: list, times: list) -> None:
    import torch

    for _ in range(steps):
        if time.monotonic() > deadline and len(losses) >= 3:
            break
        t0 = time.perf_counter()
        loop.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loop.last_loss))


def compare(ref: dict, run: dict) -> dict:
    """The spilled run against the reference: losses step by step, and the steady mini-batch time."""
    n = min(len(ref["losses"]), len(run["losses"]))
    diffs = [rel_diff(a, b) for a, b in zip(ref["losses"][:n], run["losses"][:n])]
    return {"steps_compared": n, "bit_for_bit": ref["losses"][:n] == run["losses"][:n],
            "max_rel_diff": max(diffs) if diffs else None,
            "slowdown": run["step_ms"] / ref["step_ms"] if ref["step_ms"] else None}


def measure(deadline_s: float, steps: int = STEPS, fraction: float = LIMIT_FRACTION) -> dict:
    import torch

    from slurm_antman.lab.evaluation.model_zoo import build
    from torch_patch.agent import Agent

    from .gpu_node import NvmlSampler, nvml_process_memory

    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    deadline = time.monotonic() + deadline_s
    half = time.monotonic() + deadline_s * 0.3  # the spilled run is the slow one: give it the rest
    torch.manual_seed(0)
    loop = build(MODEL, device="cuda", batch=BATCH)
    ref = _train(loop, steps, half)
    del loop
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    footprint = ref["peak_reserved_bytes"]
    limit = int(footprint * fraction)
    nvml_now = nvml_process_memory(os.getpid())
    outside = (nvml_now or 0) - torch.cuda.memory_reserved()
    agent = Agent(job_class="opportunistic", use_cuda=True).start()
    try:
        if agent.memory.spill is None:
            raise RuntimeError("the agent's memory controller has no host spill (see the log for why)")
        torch.manual_seed(0)
        loop = build(MODEL, device="cuda", batch=BATCH)
        loop.step()
        torch.cuda.synchronize()
        first_loss = float(loop.last_loss)
        t = time.perf_counter()
        agent.memory.set_limit(limit)
        limit_s = time.perf_counter() - t
        with NvmlSampler() as sampler:
            run = _train(loop, len(ref["losses"]) - 1, deadline, agent.memory.spill)
        run["losses"].insert(0, first_loss)
        run["steps"] += 1
        run["set_limit_s"] = limit_s  # includes pinning the pool's host memory
        nvml_peak = sampler.peak_mem(os.getpid())
        run["host_held_bytes"] = agent.memory.spill.held_bytes
        run["spill_failures"] = agent.memory.spill.failures
        del loop
    finally:
        agent.memory.set_limit(None)
        agent.stop()
        gc.collect()
        torch.cuda.empty_cache()
    return {"model": MODEL, "batch": BATCH, "footprint_bytes": footprint, "limit_bytes": limit,
            "outside_torch_bytes": outside, "nvml_peak_bytes": nvml_peak, "reference": ref, "spilled": run,
            **compare(ref, run)}


def run(ctx: PartContext) -> None:
    r = ctx.put("spill", measure(max(10.0, ctx.left() - 8.0)))
    sp = r["spilled"]
    ctx.check("training went on under the limit", sp["steps"] >= 3 and sp["spilled_peak_bytes"] > 0,
              {"steps": sp["steps"], "spilled_peak_bytes": sp["spilled_peak_bytes"]},
              "at least 3 steps with bytes spilled to host memory")
    ctx.check("same losses as unspilled", r["max_rel_diff"] is not None and r["max_rel_diff"] <= LOSS_RTOL,
              {"max_rel_diff": r["max_rel_diff"], "bit_for_bit": r["bit_for_bit"], "steps": r["steps_compared"]},
              f"per-step loss within {LOSS_RTOL:g} relative of the unspilled run (same seed, deterministic cuDNN)")
    bound = r["limit_bytes"] + max(0, r["outside_torch_bytes"]) + NVML_SLACK_BYTES
    ctx.check("NVML process memory under the limit", r["nvml_peak_bytes"] is not None and r["nvml_peak_bytes"] <= bound,
              r["nvml_peak_bytes"], f"<= limit + memory outside torch's allocator + {NVML_SLACK_BYTES // MiB} MiB "
              f"= {bound / MiB:.0f} MiB")
    ctx.note(f"{MODEL} batch {BATCH}: footprint {r['footprint_bytes'] / MiB:.0f} MiB, limit "
             f"{r['limit_bytes'] / MiB:.0f} MiB, spilled up to {sp['spilled_peak_bytes'] / MiB:.0f} MiB "
             f"(pool {sp['host_held_bytes'] / MiB:.0f} MiB of host memory, set up in {sp['set_limit_s']:.2f} s); "
             f"step {r['reference']['step_ms']:.1f} ms unspilled, {sp['step_ms']:.1f} ms spilled "
             f"(slowdown {r['slowdown']:.2f}x); losses " + ("bit for bit equal" if r["bit_for_bit"] else
                                                             f"within {r['max_rel_diff']:.2g} relative"))
