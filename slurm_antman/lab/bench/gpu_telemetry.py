"""Part 4: NVML telemetry against what the agents report.

The real sidecar daemon with NVML telemetry, and two jobs registered over its control socket: a
guaranteed ResNet-50 and an opportunistic LSTM language model, each with the real agent reporting to
the sidecar. While they train, NVML is sampled; afterwards the latest report the sidecar received from
each agent is compared with NVML:

- memory: NVML's per-process figure against the reserved bytes the agent reports (torch's caching
  allocator). NVML also counts what the process holds outside the allocator (CUDA context, library
  handles), so it must be at or above the report, by at most ``OUTSIDE_MAX_BYTES``;
- utilisation: the GPU's utilisation (NVML) against the sum of the agents' busy fractions
  (``busy_ms / iteration_ms``, capped at 1), the number the sidecar's emulated telemetry uses in its
  place. Once with both jobs at full duty, once with the guaranteed job alone at half duty (a
  data-loader stall): an unthrottled agent counts its whole iteration as busy, so the second shows
  what the report misses when a job leaves the GPU idle inside its iterations.
"""

from __future__ import annotations

import os
from typing import Optional

from .models import stall_ms

from .gpu_part import PartContext

MiB = 1 << 20
# A CUDA 12/13 context with cuBLAS and cuDNN loaded holds a few hundred MiB (lazy kernel loading);
# pytorch/pytorch#34323 measured 781 MB for CUDA 10 without it. 1 GiB bounds both.
OUTSIDE_MAX_BYTES = 1024 * MiB
UTIL_TOL = 0.15  # NVML's utilisation is the fraction of 1/6 s sample periods with a kernel running
WINDOW_S = 6.0


def _agreement(sc, sampler, jobs: dict[str, object]) -> dict:
    rows, busy_sum = [], 0.0
    for job_id, worker in jobs.items():
        for pid, rep in sc.reports(job_id):
            busy = min(1.0, rep.busy_ms / rep.iteration_ms) if rep.iteration_ms > 0 else 0.0
            busy_sum += busy
            rows.append({"job": job_id, "pid": pid, "reported_reserved_bytes": rep.mem_reserved_bytes,
                         "reported_busy_fraction": busy, "nvml_bytes": sampler.last_mem(pid),
                         "nvml_peak_bytes": sampler.peak_mem(pid)})
    return {"agents": rows, "nvml_util": sampler.util_mean, "reported_busy_sum": min(1.0, busy_sum)}


def measure(workdir: str, window_s: float = WINDOW_S, batch: Optional[int] = None) -> dict:
    from .gpu_node import NvmlSampler, RunningSidecar
    from .gpu_worker import Worker, start, windows

    log = os.path.join(workdir, "workers.log")
    sc = RunningSidecar()
    workers: list = []
    try:
        g = Worker("guaranteed", "resnet50", log, batch=batch, job_id="401", job_class="guaranteed",
                   endpoint=sc.register("401", "guaranteed"))
        o = Worker("opportunistic", "lstm_lm", log, batch=batch, job_id="402", job_class="opportunistic",
                   endpoint=sc.register("402", "opportunistic"))
        workers += [g, o]
        start(workers)
        with NvmlSampler() as s:
            full = windows([g, o], window_s)
        both = _agreement(sc, s, {"401": g, "402": o})
        both["windows"] = full
        g_alone = windows([g], 2.0)[0]
        stall = stall_ms(g_alone["iter_ms"], 0.5)
        with NvmlSampler() as s:
            half = windows([g], window_s, [stall])
        stalled = _agreement(sc, s, {"401": g})
        stalled["windows"], stalled["stall_ms"] = half, stall
    finally:
        for w in workers:
            w.stop()
        sc.stop()
    return {"full_duty": both, "half_duty_alone": stalled}


def run(ctx: PartContext) -> None:
    r = ctx.put("telemetry", measure(ctx.workdir))
    full = r["full_duty"]
    gaps = [(a["job"], (a["nvml_bytes"] or 0) - a["reported_reserved_bytes"]) for a in full["agents"]]
    ctx.check("every agent reported", len(full["agents"]) == 2, len(full["agents"]), "a report from both agents")
    ctx.check("NVML process memory matches the reports",
              bool(gaps) and all(0 <= gap <= OUTSIDE_MAX_BYTES for _, gap in gaps),
              {job: f"{gap / MiB:+.0f} MiB" for job, gap in gaps},
              f"NVML - reported reserved in [0, {OUTSIDE_MAX_BYTES // MiB} MiB] (context and handles)")
    for key, label in (("full_duty", "both at full duty"), ("half_duty_alone", "guaranteed alone at half duty")):
        x = r[key]
        u, b = x["nvml_util"], x["reported_busy_sum"]
        ctx.check(f"utilisation, {label}", u is not None and abs(u - b) <= UTIL_TOL,
                  {"nvml": u, "reported": b}, f"|NVML utilisation - agents' busy fraction| <= {UTIL_TOL}")
        ctx.note(f"{label}: NVML utilisation {u if u is None else round(u, 3)}, agents' busy fraction {b:.3f}; "
                 + ", ".join(f"job {a['job']} NVML {(a['nvml_bytes'] or 0) / MiB:.0f} MiB vs reported "
                             f"{a['reported_reserved_bytes'] / MiB:.0f} MiB" for a in x["agents"]))
