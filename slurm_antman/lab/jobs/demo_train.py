"""A small PyTorch training job for `antman demo`: CPU, checkpoints, resumes after a requeue.

The checkpoint holds model, optimizer and step, written atomically (temp file + rename) so a kill
at any moment leaves either the old or the new checkpoint. SIGTERM (what Slurm sends on preemption,
GraceTime seconds before SIGKILL) triggers one last checkpoint.
"""

import os
import signal
import sys
import time

import torch

ckpt = sys.argv[1]
total_steps = int(sys.argv[2])
step_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.25
# Optional: a file whose appearance ends the training early, as done (a test that must keep the job
# running for as long as its own steps take, on a machine of any speed).
stop_file = sys.argv[4] if len(sys.argv) > 4 else None
# Under `antman demo`, 20 ms of GPU work per step on the contending emulated GPU (demo_device); elsewhere
# none, as before.
device = None
if os.environ.get("ANTMAN_DEMO_DEVICE_ROOT"):
    import torch_patch
    from slurm_antman.lab.jobs.demo_device import DemoDevice

    device = DemoDevice.from_env("train", torch_patch.current())
GPU_S = 0.02
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(256, 32)
y = x[:, :1] * 2.0 + 0.5
step = 0


def save() -> None:
    # A temporary file of this process's own: were two runs of the job ever alive at once (a requeue
    # racing the old run's last save), one's rename must not take the other's half-written file.
    tmp = f"{ckpt}.{os.getpid()}.tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, ckpt)


def on_term(signum, frame):
    save()
    print(f"PREEMPTED at step {step}: checkpoint saved", flush=True)
    sys.exit(143)


signal.signal(signal.SIGTERM, on_term)
restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    step = state["step"]
print(f"START step={step} restarts={restarts} class={os.environ.get('ANTMAN_CLASS', 'none')} "
      f"gpu={os.environ.get('CUDA_VISIBLE_DEVICES', '-')}", flush=True)
while step < total_steps and not (stop_file and os.path.exists(stop_file)):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    if device is not None:
        device.step(GPU_S)
    opt.step()
    step += 1
    if step % 5 == 0:
        save()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    time.sleep(step_s)
save()
print(f"DONE step={step} loss={loss.item():.4f}", flush=True)
