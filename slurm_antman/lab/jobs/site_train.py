"""The opportunistic job of ``make gpu-site-proof`` on a real GPU: a model of the zoo trains,
checkpoints, and resumes after a requeue. The agent comes from the site's agent bundle, as for any job.

The checkpoint (model, optimizer, step) is written atomically every ``CKPT_EVERY_S`` and on SIGTERM,
what Slurm sends GraceTime seconds before SIGKILL on a requeue. The lines it prints are those of the
CPU demo's job (demo_train.py): ``START step= restarts=``, ``step N``, ``PREEMPTED at step N``.

Usage: site_train.py CKPT MODEL BATCH [STOP_FILE]; ANTMAN_SITE_DEVICE=cpu runs it on the CPU (its test).
"""

import os
import signal
import sys
import time

import torch

from slurm_antman.lab.evaluation import model_zoo

CKPT_EVERY_S = 10.0

ckpt, model_name, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
stop_file = sys.argv[4] if len(sys.argv) > 4 else None
torch.manual_seed(0)
torch.backends.cudnn.benchmark = True
device = os.environ.get("ANTMAN_SITE_DEVICE", "cuda")
loop = model_zoo.build(model_name, device, batch)
step = 0


def save() -> None:
    tmp = f"{ckpt}.{os.getpid()}.tmp"  # a file of this run's own: an old run's last save never takes it
    torch.save({"model": loop.model.state_dict(), "opt": loop.optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, ckpt)


def on_term(signum, frame):
    save()
    print(f"PREEMPTED at step {step}: checkpoint saved", flush=True)
    sys.exit(143)


signal.signal(signal.SIGTERM, on_term)
restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
if os.path.exists(ckpt):
    state = torch.load(ckpt, map_location=device)
    loop.model.load_state_dict(state["model"])
    loop.optimizer.load_state_dict(state["opt"])
    step = state["step"]
print(f"START step={step} restarts={restarts} class={os.environ.get('ANTMAN_CLASS', 'none')} "
      f"gpu={os.environ.get('CUDA_VISIBLE_DEVICES', '-')} model={model_name}", flush=True)
saved = time.monotonic()
while not (stop_file and os.path.exists(stop_file)):
    loop.step()
    step += 1
    if step % 10 == 0:
        print(f"step {step} loss {loop.last_loss.item():.4f}", flush=True)
    if time.monotonic() - saved > CKPT_EVERY_S:
        save()
        saved = time.monotonic()
save()
print(f"DONE step={step}", flush=True)
