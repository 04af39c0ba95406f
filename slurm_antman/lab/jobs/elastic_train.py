"""An elastic data-parallel training job (docs/elastic.md, "The user's side"): DDP on CPU with gloo.

    python -m torch_patch.elastic_launch elastic_train.py --ckpt PATH --log-file PATH [--steps N] [--step-s S]

It runs under torchrun (its environment: RANK, WORLD_SIZE, MASTER_ADDR, ...), and also alone
(``python elastic_train.py ...``: one process, no process group). Every start loads the checkpoint,
so it continues exactly where the checkpoint was taken, at whatever width it is restarted with:

- the data is a fixed table indexed by the global sample number; step s (counted from 1) trains on
  samples (s-1)*B ... s*B-1, B the global batch (``--global-batch``), whatever the world size: rank r
  of W takes its share of them (B // W, the first B % W ranks one more), and its loss is scaled so
  that DDP's average of the gradients is the gradient of the whole batch's mean loss;
- the checkpoint (model, optimizer, step, samples consumed) is saved by rank 0, atomically, every
  ``--ckpt-every`` steps and from the ``torch_patch.on_preempt`` hook: at a preemption notice, before
  a width change, where the agent calls it at an iteration boundary (inside ``optimizer.step()``,
  after the update) and the workers are stopped right after, and when a task of the job's elastic
  array is about to leave or has just joined (``notice.kind == "checkpoint"``; training goes on);
- rank 0 appends one JSON line per event to ``--log-file``: ``{"event": "start", "step": ..., "world_size":
  ...}`` at every start, and per step ``{"event": "step", "step", "world_size", "time", "first",
  "last", "loss"}`` (written before ``optimizer.step()``, so a step whose update the checkpoint holds
  is always logged), and ``{"event": "checkpoint", "why", "step", "time"}`` for each the hook saved.

SIGTERM (the launcher stopping the workers, or Slurm) ends the process at once (``on_term``), after
the agent has said ``bye`` to the sidecar. No checkpoint is taken there: a signal may come in the
middle of an update.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

DATA_SIZE = 4096
FEATURES = 16


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default=os.environ.get("ELASTIC_TRAIN_CKPT", "elastic_train.ckpt"),
                   help="checkpoint path (default $ELASTIC_TRAIN_CKPT or ./elastic_train.ckpt)")
    p.add_argument("--log-file", default=os.environ.get("ELASTIC_TRAIN_LOG", "elastic_train.log"),
                   help="rank 0's JSON-lines log (default $ELASTIC_TRAIN_LOG or ./elastic_train.log)")
    p.add_argument("--steps", type=int, default=100, help="train until this many steps are done")
    p.add_argument("--step-s", type=float, default=0.0, help="sleep after each step (pacing)")
    p.add_argument("--global-batch", type=int, default=8, help="samples per step, over all ranks")
    p.add_argument("--ckpt-every", type=int, default=10, help="rank 0 checkpoints every K steps")
    a = p.parse_args()
    if a.steps < 1 or a.global_batch < 1 or a.ckpt_every < 1 or a.step_s < 0:
        p.error("--steps, --global-batch and --ckpt-every must be >= 1, --step-s >= 0")
    return a


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(DATA_SIZE, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(DATA_SIZE, 1, generator=g)
    return x, y


def shard(step: int, batch: int, rank: int, world: int) -> tuple[int, int]:
    """[first, end) of rank's share of step's samples (step counted from 1)."""
    base, extra = divmod(batch, world)
    start = (step - 1) * batch + rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def on_term(signum: int, frame: object) -> None:
    """SIGTERM: the launcher stopping the workers (a width change), or Slurm. Nothing is saved here
    (the signal may come in the middle of an update): the checkpoint is the hook's or the last
    periodic one. The agent says bye to the sidecar; then the process leaves without the
    interpreter's teardown of torch, which takes about half a second on a small machine and delays
    the restart by as much (``sys.exit`` would do too, only slower)."""
    try:
        import torch_patch

        torch_patch.uninstall()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(128 + signum)


def main() -> int:
    a = parse()
    signal.signal(signal.SIGTERM, on_term)
    torch.set_num_threads(1)
    distributed = "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    if distributed:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    if a.global_batch < world:
        raise SystemExit(f"--global-batch {a.global_batch} is below the world size {world}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    state = {"step": 0}  # steps whose update is in the model
    if os.path.exists(a.ckpt):
        ck = torch.load(a.ckpt, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state["step"] = ck["step"]
        assert ck["samples"] == ck["step"] * a.global_batch, "the checkpoint was made with another --global-batch"
    net = torch.nn.parallel.DistributedDataParallel(model) if distributed else model

    def log(doc: dict) -> None:
        if rank == 0:
            with open(a.log_file, "a") as f:
                f.write(json.dumps(doc) + "\n")

    def save(why: str) -> None:
        if rank != 0:
            return
        tmp = f"{a.ckpt}.{os.getpid()}.tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": state["step"],
                    "samples": state["step"] * a.global_batch, "why": why}, tmp)
        os.replace(tmp, a.ckpt)
        if why not in ("every", "end"):  # the hook's: when it ran is what the tests look at
            log({"event": "checkpoint", "why": why, "step": state["step"], "time": time.time()})

    try:
        import torch_patch
    except ImportError:
        torch_patch = None
    if torch_patch is not None and torch_patch.current() is not None:
        # The agent runs (a slurm-antman job): its hook is where preemption and width changes save.
        torch_patch.on_preempt(lambda notice: save(notice.kind))

    log({"event": "start", "step": state["step"], "world_size": world, "time": time.time(), "pid": os.getpid()})
    x_all, y_all = data()
    while state["step"] < a.steps:
        step = state["step"] + 1
        lo, hi = shard(step, a.global_batch, rank, world)
        idx = torch.arange(lo, hi) % DATA_SIZE
        x, y = x_all[idx], y_all[idx]
        opt.zero_grad(set_to_none=True)
        per_sample = torch.nn.functional.mse_loss(net(x), y, reduction="none").sum()
        # DDP averages gradients over the ranks: scaled so the average is the batch mean's gradient.
        (per_sample * world / a.global_batch).backward()
        total = per_sample.detach().clone()
        if distributed:
            dist.all_reduce(total)
        log({"event": "step", "step": step, "world_size": world, "time": time.time(),
             "first": (step - 1) * a.global_batch, "last": step * a.global_batch - 1,
             "loss": total.item() / a.global_batch})
        state["step"] = step
        opt.step()  # the agent's boundary: a width change or preemption saves here, step included
        if step % a.ckpt_every == 0:
            save("every")
        if a.step_s:
            time.sleep(a.step_s)
    save("end")
    log({"event": "end", "step": state["step"], "world_size": world, "time": time.time()})
    if distributed:
        dist.barrier()  # every rank done before the group goes: gloo aborts a rank whose peer left first
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
