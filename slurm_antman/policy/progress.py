"""What an opportunistic job can expect to make of a GPU, from what its node's sidecar measures (pure).

Progress is the fraction of its solo rate a job makes. The prediction uses only telemetry a sidecar
has for every GPU (its utilisation and which jobs hold it), not the jobs' models, so the coordinator
(slot counts, moves) and the sidecar (which GPU backs a slot) predict the same way:

- an idle GPU: 1;
- beside opportunistic jobs only: 1 / (1 + util). The newcomer's work overlaps the others' busy
  time, a fraction ``util`` of it, and each overlap costs an even time slice (the contention penalty
  of docs/workload_model.md is unknown before the pair has run, and about 0 on average over
  Gavel's measured pairs);
- beside a guaranteed job: the compute share the local policy's slowdown target leaves, divided
  among the opportunistic jobs. Each unit of an opportunistic job's duty costs the guaranteed job
  about ``util`` of slowdown (the same overlap argument), so the target allows ``target / util``.
  Where the opportunistic jobs fill the guaranteed job's idle slots instead (``fill`` > 0: the
  fraction of the idle device time they fill, torch_patch/slots.py; simulator/slot_fill.py has the
  measured value), they share ``fill x (1 - util)``, if that is more.
"""

from __future__ import annotations

# What opportunistic jobs fill of a guaranteed job's idle device time under slot filling, as the GPU
# proof's part 8 measured it on an H100 (docs/benchmarks.md, run 4: 0.134 of the 0.49 a ResNet-50 at
# half duty left idle, the gate with one module in flight; one run of 4 s windows). The contending
# emulated GPU of `antman bench interleave` fills 0.69 (0.345 of 0.5), which its 2 ms modules flatter.
FILL_EFFICIENCY = 0.272
FILL_EFFICIENCY_EMULATED = 0.69

# Below this the measured utilisation is noise: a GPU is never treated as completely idle while a
# job holds it.
MIN_UTIL = 0.01


def predicted_progress(util: float, guaranteed_jobs: int, opportunistic_jobs: int,
                       target_slowdown: float, fill: float = 0.0) -> float:
    """What one more opportunistic job would progress at on a GPU (module doc)."""
    if guaranteed_jobs == 0 and opportunistic_jobs == 0:
        return 1.0
    u = max(MIN_UTIL, min(1.0, util))
    if guaranteed_jobs == 0:
        return 1.0 / (1.0 + u)
    duty = min(1.0, target_slowdown / u)
    return max(duty, fill * (1.0 - u)) / (opportunistic_jobs + 1)
