"""A training job of the GPU proof: one zoo model in a process of its own (two jobs on a GPU are two
CUDA contexts, time-sliced by the driver, as two Slurm jobs are), under the real agent
(``torch_patch.agent.Agent``), optionally connected to a sidecar endpoint over ZeroMQ.

The process builds and warms up, prints one JSON line ``{"ready": ...}``, then reads JSON commands on
stdin, one per line, and answers each with one JSON line on stdout:

- ``{"cmd": "window", "seconds": S, "stall_ms": X}``: train for S seconds; before each step sleep a
  random time from [0, 2X] with the GPU idle, the data-loader stall of ``models`` (its
  ``stall_ms`` gives X for a duty); answer the steps, mean mini-batch and busy time, the agent's share
  and memory, and the losses;
- ``{"cmd": "slots", "path": P, "role": R[, "inflight_s": S]}``: use the idle-slot page at P as R
  (publish, fill, or null: none; ``Agent.set_slot_page``), a gate with S seconds of work in flight; ``{"cmd": "share", "share": S}``: throttle to S; both
  answer ``{"ok": true}``;
- ``{"cmd": "quit"}``.

Between commands the process waits on stdin, launching nothing: a job at share 0. The agent's own
thread keeps its heartbeats going meanwhile.

:class:`Worker` is the parent's handle; :func:`start` starts several at once (their start-ups overlap).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time
from typing import Any, Optional, Sequence

READY_TIMEOUT_S = 120.0


# --- the worker process ---------------------------------------------------------------------------


def _emit(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def window(loop: Any, agent: Any, seconds: float, stall_ms: float, sync: Any, rng: random.Random) -> dict:
    n, busy, losses = 0, 0.0, []
    stall_s = stall_ms / 1000.0
    t0 = time.perf_counter()
    while True:
        if stall_s > 0:
            time.sleep(rng.uniform(0.0, 2.0 * stall_s))  # after the last sync: the GPU idles
        s0 = time.perf_counter()
        loop.step()  # its optimizer.step() is the agent's iteration boundary
        sync()  # a mini-batch ends when its kernels do, not when Python has queued them
        busy += time.perf_counter() - s0
        n += 1
        if loop.last_loss is not None and n <= 64:
            losses.append(float(loop.last_loss))
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            break
    st = agent.memory.stats()
    return {"steps": n, "iter_ms": elapsed / n * 1000.0, "busy_ms": busy / n * 1000.0, "stall_ms": stall_ms,
            "share": agent.throttle.share, "applied_seq": agent.applied_seq, "mem": st.as_dict(),
            "losses": losses, "pid": os.getpid()}


def worker_main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slurm_antman.lab.bench.gpu_worker")
    ap.add_argument("--model", required=True, help="the model-zoo model to train (slurm_antman.lab.evaluation.model_zoo)")
    ap.add_argument("--batch", type=int, help="mini-batch size (default: the model's own)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights, the synthetic data and the stalls")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="train on the GPU or on the CPU")
    ap.add_argument("--warmup", type=int, default=3, help="mini-batches trained before the ready line")
    ap.add_argument("--job-id", help="the job id the agent registers with the sidecar as")
    ap.add_argument("--job-class", default="none", choices=("none", "guaranteed", "opportunistic"),
                    help="the agent's job class")
    ap.add_argument("--endpoint", help="sidecar endpoint the agent connects to over ZeroMQ (default: none, "
                                       "the agent runs unconnected)")
    a = ap.parse_args(argv)

    import torch

    from slurm_antman.lab.evaluation.model_zoo import build
    from torch_patch.agent import Agent

    cuda = a.device == "cuda"
    agent = Agent(job_id=a.job_id, job_class=a.job_class, endpoint=a.endpoint, use_cuda=cuda).start()
    if agent.client is not None and not agent.client.registered.wait(30):
        raise RuntimeError(f"the agent did not register with {a.endpoint} within 30 s")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(a.seed)
    loop = build(a.model, device=a.device, batch=a.batch)
    for _ in range(a.warmup):
        loop.step()
    sync()
    _emit({"ready": True, "pid": os.getpid(), "batch": loop.batch, "job_class": a.job_class})
    rng = random.Random(a.seed)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("cmd") == "quit":
                break
            if cmd.get("cmd") == "slots":
                agent.set_slot_page(cmd.get("path"), cmd.get("role"))
                if agent.slot_gate is not None and cmd.get("inflight_s") is not None:
                    inflight = float(cmd["inflight_s"])
                    if not 0.0 <= inflight <= 1.0:
                        raise ValueError(f"inflight_s must be in [0, 1] seconds, got {inflight}")
                    agent.slot_gate.inflight_ns = int(inflight * 1e9)
                _emit({"ok": True, "publisher": agent.slot_publisher is not None, "gate": agent.slot_gate is not None})
                continue
            if cmd.get("cmd") == "share":
                agent.throttle.set_share(float(cmd["share"]))
                _emit({"ok": True})
                continue
            if cmd.get("cmd") != "window":
                raise ValueError(f"unknown command {cmd!r}; allowed: window, slots, share, quit")
            out = window(loop, agent, float(cmd["seconds"]), float(cmd.get("stall_ms", 0.0)), sync, rng)
            gate = agent.slot_gate
            if gate is not None:
                out["gate"] = {"waited_s": gate.waited_s, "launches": gate.launches, "blind": gate.blind,
                               "forced": gate.forced, "work_ms": gate.work_ns / 1e6,
                               "most_in_flight": gate.most_in_flight, "inflight_ms": gate.inflight_ns / 1e6}
            _emit(out)
    finally:
        agent.stop()
    return 0


# --- the parent's handle --------------------------------------------------------------------------


class WorkerError(RuntimeError):
    pass


class Worker:
    def __init__(self, name: str, model: str, log_path: str, batch: Optional[int] = None, seed: int = 0,
                 device: str = "cuda", job_id: Optional[str] = None, job_class: str = "none",
                 endpoint: Optional[str] = None) -> None:
        from .gpu import _child_env

        cmd = [sys.executable, "-m", "slurm_antman.lab.bench.gpu_worker", "--model", model, "--seed", str(seed),
               "--device", device, "--job-class", job_class]
        for flag, v in (("--batch", batch), ("--job-id", job_id), ("--endpoint", endpoint)):
            if v is not None:
                cmd += [flag, str(v)]
        self.name = name
        self._log = open(log_path, "a")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=_child_env())
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.pid = self.proc.pid
        self.info: dict = {}

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def recv(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise WorkerError(f"worker {self.name} did not answer within {timeout:.0f} s") from None
            if line is None:
                raise WorkerError(f"worker {self.name} exited ({self.proc.wait()}); see its log {self._log.name}")
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)

    def send(self, cmd: dict) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "quit"})
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start(workers: Sequence[Worker], timeout: float = READY_TIMEOUT_S) -> None:
    """Waits until every worker has built and warmed up (they start in parallel)."""
    for w in workers:
        w.info = w.recv(timeout)


def windows(workers: Sequence[Worker], seconds: float, stalls_ms: Optional[Sequence[float]] = None) -> list[dict]:
    """One window on each of ``workers`` at the same time (the others stay idle)."""
    stalls_ms = stalls_ms or [0.0] * len(workers)
    for w, st in zip(workers, stalls_ms):
        w.send({"cmd": "window", "seconds": seconds, "stall_ms": st})
    return [w.recv(seconds * 20 + 60) for w in workers]


if __name__ == "__main__":
    sys.exit(worker_main())
