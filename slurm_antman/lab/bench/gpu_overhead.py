"""Part 5: the agent's overhead on a real model, alone on the GPU.

Zoo ResNet-50 under the real agent, reporting over ZeroMQ IPC to the bench sidecar of ``antman bench
control`` (``control.agent_with_peer``, in a process of its own as a sidecar is on a node). The
measurement is ``control.measure_overhead``: the same loop with the agent's hooks attached and
detached in A-B-B-A rounds (neither side always first), the ratio's median; the same rounds with both
sides detached (A/A) give the ratio the machine's noise alone reports. Each iteration ends with a
synchronize, so a mini-batch is timed to the end of its kernels.
"""

from __future__ import annotations

import os

from .gpu_part import PartContext

MODEL, BATCH = "resnet50", 32
# The agent's promise (docs/benchmarks.md, `antman bench control`): at most 1 % on top of the job.
MAX_OVERHEAD = 0.01


def measure(workdir: str, iters: int = 20, rounds: int = 6, device: str = "cuda") -> dict:
    import torch

    from .control import agent_with_peer, measure_overhead
    from slurm_antman.lab.evaluation.model_zoo import build

    with agent_with_peer(os.path.join(workdir, "o", "agent.sock"), use_cuda=device == "cuda") as (agent, _conn):
        torch.manual_seed(0)
        loop = build(MODEL, device=device, batch=BATCH)

        def iteration() -> None:
            loop.step()
            if device == "cuda":
                torch.cuda.synchronize()

        r = measure_overhead(agent, iters=iters, rounds=rounds, iteration=iteration)
        r["report_gap_s"] = agent._report_gap  # as the agent spaced them while it trained
        # The same rounds with reports off: what the boundary costs without them, to tell which it is.
        base_ivl, agent.report_interval_s, agent._report_gap = agent.report_interval_s, 1e9, 1e9
        quiet = measure_overhead(agent, iters=iters, rounds=max(2, rounds // 2), iteration=iteration)
        agent.report_interval_s = agent._report_gap = base_ivl
        r["ratio_without_reports"], r["control_without_reports"] = quiet["ratio"], quiet["control"]
        r["report_us"] = _report_us(agent)
        # The same rounds publishing on an idle-slot page (docs/protocol.md, "The idle-slot page"): what
        # a guaranteed job pays for slot filling next to it (one event per boundary, one hook call per
        # iteration).
        from slurm_antman.protocol import slot_page

        page = os.path.join(workdir, "o", "slots.page")
        slot_page.create(page)
        agent.set_slot_page(page, "publish")
        if agent.slot_publisher is None:
            raise RuntimeError(f"the agent did not open the idle-slot page {page}")
        pub = measure_overhead(agent, iters=iters, rounds=rounds, iteration=iteration)
        agent.set_slot_page(None, None)
        r["ratio_publishing"], r["control_publishing"] = pub["ratio"], pub["control"]
        r["boundary_publishing_us"] = pub["boundary_us"]
    return {"model": MODEL, "batch": BATCH, "iters": iters, "rounds": rounds, **r}


def _report_us(agent, n: int = 20) -> float:
    """One report's own cost on this GPU (reading the allocator, encoding, sending): the agent spaces
    its reports by it (torch_patch.agent.REPORT_BUDGET)."""
    import time

    total = 0.0
    for _ in range(n):
        agent._acc_n, agent._acc_ms, agent._acc_busy_ms = 1, 1.0, 1.0
        t = time.perf_counter()
        agent._send_report(agent.iteration, time.monotonic())
        total += time.perf_counter() - t
    return total / n * 1e6


def run(ctx: PartContext) -> None:
    rounds = 6 if ctx.left() > 35 else 3
    r = ctx.put("overhead", measure(ctx.workdir, rounds=rounds))
    noise = abs(r["control"] - 1.0)
    ctx.check("overhead within 1% (beyond the A/A noise)", r["ratio"] - 1.0 <= MAX_OVERHEAD + noise,
              {"ratio": r["ratio"], "control": r["control"]},
              f"agent/no-agent ratio - 1 <= {MAX_OVERHEAD:.0%} + |A/A ratio - 1|")
    ctx.note(f"{MODEL} batch {BATCH}: {r['iteration_us'] / 1000:.1f} ms per step; with/without agent "
             f"{r['ratio']:.4f}, A/A control {r['control']:.4f}; one boundary {r['boundary_us']:.0f} us; "
             f"one report {r['report_us']:.0f} us, reports {r['report_gap_s'] * 1000:.0f} ms apart; with reports "
             f"off {r['ratio_without_reports']:.4f} (A/A {r['control_without_reports']:.4f})")
    noise = abs(r["control_publishing"] - 1.0)
    ctx.check("publishing idle slots within 1% (beyond the A/A noise)",
              r["ratio_publishing"] - 1.0 <= MAX_OVERHEAD + noise,
              {"ratio": r["ratio_publishing"], "control": r["control_publishing"]},
              f"agent publishing on a page / no agent - 1 <= {MAX_OVERHEAD:.0%} + |A/A ratio - 1|")
    ctx.note(f"publishing on an idle-slot page: with/without agent {r['ratio_publishing']:.4f}, A/A control "
             f"{r['control_publishing']:.4f}; one boundary {r['boundary_publishing_us']:.0f} us")
