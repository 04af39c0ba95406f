"""The guaranteed job of `antman demo`: trains a small model on an emulated GPU whose memory footprint
follows a phase the demo writes into a file (``base``, ``grow``, ``burst``), as a real job's does when
it enters evaluation or a larger batch. CPU only: the GPU memory is emulated (the agent reports it to
the sidecar as a GPU job's would be); everything around it (Slurm, the sidecar, the coordinator, the
neighbour's agent) is real.

Usage: demo_guaranteed.py PHASE_FILE
"""

import os
import sys
import time

import torch
import torch_patch

MIB = 1 << 20
FOOTPRINT = {"base": 512 * MIB, "grow": 1536 * MIB, "burst": 3400 * MIB}

agent = torch_patch.install()
# 6 % busy: a guaranteed job that leaves its GPU mostly idle (data loading, evaluation, a notebook), the
# room AntMan fills. In Philly, 29 % of the utilisation samples of single-GPU jobs read 0 % (Jeon et al.,
# ATC'19, Figures 5-6, as read in docs/workload_model.md). Beside a busier job the sidecar would predict
# too little progress for a neighbour (target_slowdown / utilisation) and keep it off this GPU.
agent.emulate_device(FOOTPRINT["base"], 0.06)
# Under `antman demo` its GPU work (3 ms of each ~53 ms step: the 6 %) runs on the contending emulated GPU
# (demo_device), where a neighbour's kernels really delay it; elsewhere the step only sleeps.
device = None
if os.environ.get("ANTMAN_DEMO_DEVICE_ROOT"):
    from slurm_antman.lab.jobs.demo_device import DemoDevice

    device = DemoDevice.from_env("guaranteed", agent)
GPU_S = 0.003
phase_file = sys.argv[1]
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(64, 32)
step, shown = 0, None
while True:
    try:
        with open(phase_file) as f:
            phase = f.read().strip() or "base"
    except OSError:
        phase = "base"
    agent.memory.emulate(FOOTPRINT.get(phase, FOOTPRINT["base"]))
    opt.zero_grad()
    model(x).square().mean().backward()
    if device is not None:
        device.step(GPU_S)
    opt.step()
    step += 1
    if phase != shown or step % 20 == 0:
        print(f"step {step} phase={phase} gpu_mem={FOOTPRINT.get(phase, FOOTPRINT['base']) // MIB}MiB", flush=True)
        shown = phase
    time.sleep(0.05)
