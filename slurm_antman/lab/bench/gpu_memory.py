"""Part 1: the memory limit (``torch_patch.memory.MemoryController``) on a real GPU.

- ``shrink_grow``: memory cached by the allocator is handed back when the limit goes down (PyTorch's
  per-process fraction frees nothing by itself; the controller empties the cache), an allocation
  larger than the new limit fails with CUDA OOM, and after the limit goes up the same allocation
  succeeds.
- ``limits_while_training``: zoo ResNet-50 trains under the real agent, connected over ZeroMQ IPC to a
  sidecar peer (``control.PeerSidecar``, the sidecar side of docs/protocol.md) that sends a
  schedule of limits, down and up, all above the model's footprint. Each must be applied at the
  boundary after the iteration it arrived in (the agent's ack says which), and after a shrink the
  memory torch holds must be under the limit.
"""

from __future__ import annotations

import os
from typing import Optional

from .gpu_part import PartContext

MiB = 1 << 20
# ResNet-50 at a batch of 32 is the zoo's ResNet-50 at its profile batch (workloads.py): 32 per GPU.
MODEL, BATCH = "resnet50", 32
# Limits as multiples of the peak memory torch reserved in the unlimited iterations: down close to it
# (the allocator's rounding and fragmentation need some slack over the peak), up, down, and none.
SCHEDULE = (1.5, 1.15, 3.0, 1.25, None)


def shrink_grow(cached_mib: int = 512, limit_mib: int = 256, request_mib: int = 400) -> dict:
    import torch

    from torch_patch.memory import MemoryController

    mc = MemoryController(use_cuda=True)
    out: dict = {"cached_mib": cached_mib, "limit_mib": limit_mib, "request_mib": request_mib}
    try:
        x = torch.empty(cached_mib * MiB, dtype=torch.uint8, device="cuda")
        del x
        out["reserved_before_shrink"] = torch.cuda.memory_reserved()
        mc.set_limit(limit_mib * MiB)
        out["reserved_after_shrink"] = torch.cuda.memory_reserved()
        try:
            torch.empty(request_mib * MiB, dtype=torch.uint8, device="cuda")
            out["oom_under_limit"] = False
        except torch.OutOfMemoryError:
            out["oom_under_limit"] = True
        mc.set_limit(2 * request_mib * MiB)
        try:
            y = torch.empty(request_mib * MiB, dtype=torch.uint8, device="cuda")
            out["grown_allocation_ok"] = True
            out["allocated_after_grow"] = mc.stats().allocated_bytes
            del y
        except torch.OutOfMemoryError:
            out["grown_allocation_ok"] = False
    finally:
        mc.set_limit(None)
        torch.cuda.empty_cache()
    return out


def limits_while_training(ctx: Optional[PartContext], workdir: str, steps_between: int = 3,
                          max_wait_steps: int = 30) -> dict:
    import torch

    from slurm_antman import protocol as P
    from .control import PeerSidecar
    from slurm_antman.lab.evaluation.model_zoo import build
    from torch_patch.agent import Agent

    peer = PeerSidecar(os.path.join(workdir, "m", "agent.sock"), job_id="101", job_class="guaranteed").start()
    agent = Agent(job_id="101", job_class="guaranteed", endpoint=P.ipc(peer.path), use_cuda=True).start()
    changes = []
    try:
        if not agent.client.registered.wait(30):
            raise RuntimeError("the agent did not register with the peer sidecar")
        torch.manual_seed(0)
        loop = build(MODEL, device="cuda", batch=BATCH)
        for _ in range(steps_between + 2):
            loop.step()
        torch.cuda.synchronize()
        footprint = torch.cuda.max_memory_reserved()
        for factor in SCHEDULE:
            if ctx is not None and ctx.left() < 5:
                break
            limit = None if factor is None else int(footprint * factor)
            seq, _ = peer.send_limits(limit, 1.0)
            try:
                for _ in range(max_wait_steps):
                    loop.step()
                    if agent.applied_seq >= seq:
                        break
                torch.cuda.synchronize()
                ack = next((a for a in agent.acks if a[0] == seq), None)
                for _ in range(steps_between):  # and it keeps training under it
                    loop.step()
                torch.cuda.synchronize()
            except torch.OutOfMemoryError as e:
                # A guaranteed job has no spill: the limit was under what this model needs after all.
                # No boundary comes while every step fails, so no later limit could be applied: stop.
                changes.append({"seq": seq, "limit_bytes": limit, "received_iteration": None,
                                "applied_iteration": None, "reserved_bytes": torch.cuda.memory_reserved(),
                                "oom": str(e).splitlines()[0][:300]})
                break
            changes.append({
                "seq": seq, "limit_bytes": limit, "received_iteration": ack[1] if ack else None,
                "applied_iteration": ack[2] if ack else None,
                "reserved_bytes": torch.cuda.memory_reserved(), "loss": float(loop.last_loss)})
    finally:
        agent.stop()
        peer.stop()
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    return {"model": MODEL, "batch": BATCH, "footprint_reserved_bytes": footprint, "changes": changes}


def run(ctx: PartContext) -> None:
    sg = ctx.put("shrink_grow", shrink_grow())
    ctx.check("shrink frees the cache", sg["reserved_after_shrink"] < sg["reserved_before_shrink"],
              {"before": sg["reserved_before_shrink"], "after": sg["reserved_after_shrink"]},
              "reserved bytes drop below what was cached when the limit goes down")
    ctx.check("allocation over the limit fails", sg["oom_under_limit"], sg["oom_under_limit"],
              f"torch.empty({sg['request_mib']} MiB) raises OutOfMemoryError under a {sg['limit_mib']} MiB limit")
    ctx.check("grow admits it", sg["grown_allocation_ok"], sg["grown_allocation_ok"],
              f"the same {sg['request_mib']} MiB allocation succeeds after the limit goes up")
    tr = ctx.put("while_training", limits_while_training(ctx, ctx.workdir))
    ch = tr["changes"]
    lag = [c["applied_iteration"] - c["received_iteration"] for c in ch
           if c["applied_iteration"] is not None and c["received_iteration"] is not None]
    ctx.check("every change acknowledged", len(ch) == len(SCHEDULE) and len(lag) == len(ch),
              f"{len(lag)} of {len(SCHEDULE)}", "each limit of the schedule applied and acknowledged")
    ctx.check("applied at the next iteration", bool(lag) and max(lag) == 1, lag,
              "applied_iteration - received_iteration == 1 for every change")
    over = [c for c in ch if c["limit_bytes"] is not None and c["reserved_bytes"] > c["limit_bytes"]]
    ctx.check("torch holds no more than the limit", not over,
              [(c["limit_bytes"], c["reserved_bytes"]) for c in over] or "none over",
              "memory_reserved() <= limit after each change, training on")
    ctx.note(f"{MODEL} batch {BATCH}: footprint (peak reserved) {tr['footprint_reserved_bytes'] / MiB:.0f} MiB; "
             "limits " + ", ".join("none" if c["limit_bytes"] is None else f"{c['limit_bytes'] / MiB:.0f} MiB"
                                   for c in ch) + f"; applied after {lag} iteration(s)")
