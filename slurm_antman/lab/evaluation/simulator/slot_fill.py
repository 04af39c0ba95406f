"""The simulator's slot-filling compute mode (docs/workload_model.md, "Interference and control"): how
fast jobs progress on a GPU where the opportunistic jobs launch only into the guaranteed job's idle
slots (torch_patch/slots.py) instead of running under the duty throttle. Pure: no clock, no state.

The model has two named parameters. The defaults are **measured on a GPU**, once: the GPU proof's
part 8 on an H100 (docs/benchmarks.md, "Run 4"), a guaranteed ResNet-50 at half duty beside an
opportunistic one, the gate with one module in flight. The same quantities on the contending emulated
GPU (``antman bench interleave``) are given beside them; ``--fill-efficiency`` and ``--slot-leak``
take either:

- ``fill_efficiency``: the fraction of the guaranteed job's idle device time that opportunistic work
  fills. The gate stops before a slot is predicted to end (margin 0.8 of the mean idle period), bounds
  its work in flight and polls the page. H100: 0.134 of the 0.49 left idle, **0.272**. Emulated, with
  stalls drawn from mean x [0.8, 1.2]: 0.345 of 0.5, 0.69 (stalls anywhere in [0, 2 x mean]: 0.52).
  The H100's gate synchronised after every module of a launch-bound model; the gate that keeps
  ``torch_patch.slots.INFLIGHT_S`` of work in flight is not measured yet.
- ``leak``: the guaranteed job's slowdown, from the opportunistic work still in flight when its next
  burst begins (the device never preempts) and the context switch before it. H100: 1.024, **0.024**.
  Emulated: 1.002-1.006, 0.004 (its switch cost is an assumption, contended_gpu: 0.1 ms).

Device time left idle by the guaranteed job (utilisation ``u_g``: the fraction of the time its
kernels run, its duty times its profile's SM busy fraction) is ``fill_efficiency x (1 - u_g)`` of the
wall time; the opportunistic jobs divide it evenly by device time (a job needing less than its part
leaves the rest to the others), and one of utilisation ``u_o`` given device time ``t`` progresses at
``t / u_o`` of its solo rate, at most 1. Beside each other (no guaranteed job) opportunistic jobs are
not gated: the duty model applies there as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from slurm_antman.policy.progress import FILL_EFFICIENCY

# The guaranteed job's slowdown under slot filling, measured with FILL_EFFICIENCY (module doc).
LEAK = 0.024
LEAK_EMULATED = 0.004

COMPUTE_MODES = ("duty", "slots")


@dataclass(frozen=True)
class SlotFillParams:
    fill_efficiency: float = FILL_EFFICIENCY
    leak: float = LEAK

    def check(self) -> None:
        if not 0.0 < self.fill_efficiency <= 1.0:
            raise ValueError(f"--fill-efficiency must be in (0, 1], got {self.fill_efficiency}")
        if not 0.0 <= self.leak < 1.0:
            raise ValueError(f"--slot-leak must be in [0, 1), got {self.leak}")


def slot_rates(guaranteed_duty: float, opp_duties: Sequence[float], p: SlotFillParams) -> tuple[float, list[float]]:
    """(the guaranteed job's rate, each opportunistic job's rate) on one GPU, solo = 1, from their
    utilisations (``*_duty``: device-busy fractions). 0 (a paused job) gets rate 0 and no device time."""
    idle = p.fill_efficiency * max(0.0, 1.0 - min(1.0, guaranteed_duty))
    rates = [0.0] * len(opp_duties)
    active = [i for i, b in enumerate(opp_duties) if b > 0]
    left = idle
    # Water-filling by device time: a job that needs less than an even part takes only what it needs.
    while active and left > 1e-12:
        part = left / len(active)
        sated = [i for i in active if opp_duties[i] * (1.0 - rates[i]) <= part + 1e-15]
        if not sated:
            for i in active:
                rates[i] += part / opp_duties[i]
            break
        for i in sated:
            left -= opp_duties[i] * (1.0 - rates[i])
            rates[i] = 1.0
        active = [i for i in active if i not in sated]
    rates = [min(1.0, r) for r in rates]
    g_rate = 1.0 / (1.0 + p.leak) if any(r > 0 for r in rates) else 1.0
    return g_rate, rates
