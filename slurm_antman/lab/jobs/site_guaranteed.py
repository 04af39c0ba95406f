"""The guaranteed job of ``make gpu-site-proof`` on a real GPU: a model of the zoo trains, and its GPU
memory follows a phase the proof writes into a file (``base``, ``grow``, ``burst``), as a real job's does
when it enters evaluation or a larger batch. The agent is not imported here: the site's agent bundle
loads it when the job imports torch (docs/admin.md, "The agent bundle").

The extra memory of a phase is held as 256 MiB tensors, taken a few per training step so that the agent
keeps reporting while demand rises: the sidecar sees the demand as it comes and shrinks, then pauses,
the opportunistic neighbour. An allocation that finds the GPU full is retried at the next step, and the
job counts those waits (``waits=``): a burst that outruns the node loop shows there, not as a crash.
``grow`` holds a quarter of the GPU; ``burst`` all but 1 GiB of it, less than the neighbour's minimum
(``NodePolicyParams.min_opportunistic_bytes``, 1 GiB) once the headroom is kept.

Usage: site_guaranteed.py MODEL BATCH PHASE_FILE (the phase file last, as the loop appends it: lab/demo.py)
ANTMAN_SITE_DEVICE=cpu runs it on the CPU against a notional 1 GiB GPU (tests/test_site_proof.py).
"""

import os
import sys
import time

import torch

from slurm_antman.lab.evaluation import model_zoo

MIB = 1 << 20
CHUNK = 256 * MIB
PER_STEP = 8  # chunks taken at most per step: 2 GiB, about a tenth of a second of the loop's reports

model_name, batch, phase_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
device = os.environ.get("ANTMAN_SITE_DEVICE", "cuda")
cuda = device == "cuda"
torch.backends.cudnn.benchmark = True
loop = model_zoo.build(model_name, device, batch)
total = torch.cuda.mem_get_info()[1] if cuda else 1 << 30
held: list[torch.Tensor] = []
waits = 0


def reserved() -> int:
    return torch.cuda.memory_reserved() if cuda else len(held) * CHUNK


def extra_for(phase: str) -> int:
    if phase == "grow":
        return total // 4
    if phase == "burst":
        return max(0, total - (1 << 30) - reserved() + len(held) * CHUNK)
    return 0


step, shown, t0 = 0, None, time.perf_counter()
while True:
    try:
        with open(phase_file) as f:
            phase = f.read().strip() or "base"
    except OSError:
        phase = "base"
    want = extra_for(phase) // CHUNK
    if len(held) > want:
        del held[want:]
        if cuda:
            torch.cuda.empty_cache()  # handed back to the driver, where the neighbour can take it again
    for _ in range(min(PER_STEP, want - len(held))):
        try:
            held.append(torch.empty(CHUNK, dtype=torch.uint8, device=device))
        except torch.OutOfMemoryError:
            waits += 1
            break
    loop.step()
    step += 1
    if phase != shown or step % 20 == 0:
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1000 / (20 if phase == shown else 1)
        print(f"step {step} phase={phase} gpu_mem={reserved() // MIB}MiB held={len(held) * CHUNK // MIB}MiB "
              f"waits={waits} step_ms={ms:.1f}", flush=True)
        shown, t0 = phase, time.perf_counter()
