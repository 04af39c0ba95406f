"""Part 8: slot filling on a real GPU: the parameters the simulator's
``--compute slots`` takes from the contending emulated GPU (fill efficiency, leak), measured where
kernels really run.

A guaranteed ResNet-50 with an input stall as long as its step (duty about 0.5) and an opportunistic
ResNet-50 without one, each in a process of its own under the real agent (``gpu_worker``), on one GPU:

- alone, each, for its solo step and progress;
- together under the duty throttle at two fixed shares (``SHARES``): what the throttle buys;
- together with slot filling: the guaranteed agent publishes on an idle-slot page, the opportunistic
  agent's gate launches each module only into the guaranteed job's idle slots, at most one module in
  flight (module granularity: every module waits for the previous one to drain).

Measured: the guaranteed job's slowdown (its mini-batch, stall included, against alone), the
opportunistic job's progress (steps per second against alone), and the gate's own account (time
waited, launches, launches it could not judge, work per module). The fill efficiency is the
opportunistic progress over the idle share the guaranteed job leaves (``1 - its NVML-free busy
fraction``, from its own busy time alone), the leak its slowdown minus 1.
"""

from __future__ import annotations

import os
from typing import Optional

from torch_patch.slots import INFLIGHT_S

from .gpu_part import PartContext

MODEL, BATCH = "resnet50", 64
# 0.05 as well: on an H100 share 0.1 already slowed the guaranteed job 5.4 % (run 4), so without it no
# duty share held 2 % and the comparison below had nothing to compare against.
SHARES = (0.05, 0.1, 0.2)
# The bound for slot filling's cost to the guaranteed job, with the GPU's noise on top.
MAX_SLOWDOWN = 1.05


def measure(workdir: str, window_s: float, device: str = "cuda", batch: Optional[int] = BATCH,
            model: str = MODEL) -> dict:
    from slurm_antman.protocol import slot_page as sp

    from .gpu_worker import Worker, start, windows

    log = os.path.join(workdir, "slots.log")
    g = Worker("guaranteed", model, log, batch=batch, seed=1, device=device, job_class="guaranteed")
    o = Worker("opportunistic", model, log, batch=batch, seed=2, device=device, job_class="opportunistic")
    out: dict = {"model": model, "batch": batch, "window_s": window_s, "modes": {}}
    try:
        start([g, o])
        # The stall: as long as the guaranteed job's own step, so its device is idle about half the time.
        g_probe = windows([g], 2.0)[0]
        stall_ms = g_probe["busy_ms"]
        out["stall_ms"] = stall_ms
        g_alone = windows([g], window_s, [stall_ms])[0]
        o_alone = windows([o], window_s)[0]
        out["modes"]["alone"] = {"guaranteed": g_alone, "opportunistic": o_alone}
        for share in SHARES:
            o.send({"cmd": "share", "share": share})
            o.recv(30)
            rg, ro = windows([g, o], window_s, [stall_ms, 0.0])
            out["modes"][f"duty {share:g}"] = {"guaranteed": rg, "opportunistic": ro}
        o.send({"cmd": "share", "share": 1.0})
        o.recv(30)
        page = os.path.join(workdir, "gpu0.slots")
        sp.create(page)
        # The gate as run 4 measured it (one module in flight), then with the agent's default budget.
        for mode, inflight in (("slots, one module", 0.0), ("slots", INFLIGHT_S)):
            for w, role in ((g, "publish"), (o, "fill")):
                w.send({"cmd": "slots", "path": page, "role": role, "inflight_s": inflight})
                ack = w.recv(30)
                if not (ack.get("publisher") or ack.get("gate")):
                    raise RuntimeError(f"{w.name} did not open the page as {role}: {ack}")
            rg, ro = windows([g, o], window_s, [stall_ms, 0.0])
            out["modes"][mode] = {"guaranteed": rg, "opportunistic": ro}
    finally:
        for w in (g, o):
            w.stop()
    base_g, base_o = out["modes"]["alone"]["guaranteed"], out["modes"]["alone"]["opportunistic"]
    idle = max(0.0, 1.0 - base_g["busy_ms"] / base_g["iter_ms"])
    out["guaranteed_idle_fraction"] = idle
    for name, m in out["modes"].items():
        rg, ro = m["guaranteed"], m["opportunistic"]
        m["guaranteed_slowdown"] = (stall_ms + rg["busy_ms"]) / (stall_ms + base_g["busy_ms"])
        m["opportunistic_progress"] = base_o["iter_ms"] / ro["iter_ms"] if ro["steps"] else 0.0
    for key, mode in (("", "slots"), ("_one_module", "slots, one module")):
        s = out["modes"][mode]
        out["fill_efficiency" + key] = s["opportunistic_progress"] / idle if idle > 0 else None
        out["leak" + key] = s["guaranteed_slowdown"] - 1.0
    return out


def run(ctx: PartContext) -> None:
    # Every mode's window the same: the two solo runs, the duty shares and slot filling.
    window_s = max(3.0, min(8.0, (ctx.left() - 40.0) / (len(SHARES) + 4)))
    r = ctx.put("slots", measure(ctx.workdir, window_s))
    modes = r["modes"]
    for name in [n for n in modes if n != "alone"]:
        m = modes[name]
        ctx.note(f"{name}: guaranteed slowdown {m['guaranteed_slowdown']:.3f}, opportunistic progress "
                 f"{m['opportunistic_progress']:.3f}"
                 + (f"; gate {m['opportunistic'].get('gate')}" if name.startswith("slots") else ""))
    fill = {k: None if r[k] is None else round(r[k], 3) for k in ("fill_efficiency", "fill_efficiency_one_module")}
    ctx.note(f"guaranteed idle fraction alone {r['guaranteed_idle_fraction']:.2f}; fill efficiency "
             f"{fill['fill_efficiency']}, one module in flight {fill['fill_efficiency_one_module']} (run 4, "
             f"one module: 0.272; emulated GPU: 0.69); leak {r['leak']:+.3f}, one module "
             f"{r['leak_one_module']:+.3f} (run 4: +0.024; emulated: +0.004)")
    slots = modes["slots"]
    ctx.check("slot filling keeps the guaranteed job within 5 %", slots["guaranteed_slowdown"] <= MAX_SLOWDOWN,
              round(slots["guaranteed_slowdown"], 4), f"guaranteed slowdown <= {MAX_SLOWDOWN}")
    best_duty = max((modes[n] for n in modes if n.startswith("duty")
                     if modes[n]["guaranteed_slowdown"] <= 1.02), key=lambda m: m["opportunistic_progress"],
                    default=None)
    ctx.check("slot filling makes more progress than the duty throttle at 2 %",
              # No duty share within 2 % is no evidence either way: not met, rather than passed unseen.
              best_duty is not None and slots["opportunistic_progress"] > best_duty["opportunistic_progress"],
              {"slots": round(slots["opportunistic_progress"], 4),
               "duty within 2 %": None if best_duty is None else round(best_duty["opportunistic_progress"], 4)},
              "opportunistic progress with slots > that of the best duty share holding 2 %")
