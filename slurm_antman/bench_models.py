"""``antman bench models``: measure the workload model's profiles by training the real models.

For every profile of ``evaluation.workloads`` the zoo (``evaluation.model_zoo``) holds the real
PyTorch model, batch and optimizer. This command trains them on synthetic data and reports, next to
the numbers the workload model uses:

- ``--device meta`` (the default without a GPU): the peak tensor memory of a steady-state training
  step, counted without a GPU (``evaluation.memory_trace``), plus the CUDA context a process adds.
- ``--device cuda``: each model alone on the GPU, in its own process (mini-batch time,
  ``torch.cuda`` peak allocated/reserved bytes, the process's memory and the GPU's utilisation as
  NVML reports them), then, with ``--pairs-with``, each model beside each named partner at the same
  time on the same GPU with no control: both mini-batch times against their solo times give the
  interference, printed next to what the workload model takes from Gavel's published pairs.
- ``--device cpu`` runs the same process machinery on the CPU (the numbers mean nothing for a GPU;
  it exists so the machinery is tested where there is no GPU).

Each timed model runs in a worker process of its own (this module with ``--worker``), so a pair
shares the GPU the way two Slurm jobs would: two CUDA contexts, time-sliced by the driver. The
workers build and warm up, say ``ready``, and start their timed window together on ``go``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from typing import Any, Optional, Sequence

from .evaluation.workloads import BY_NAME, GiB

# What a PyTorch process holds on a GPU before its first tensor: the CUDA context and the loaded
# kernel images. pytorch/pytorch#34323 reports 781 MB in nvidia-smi for a process that only
# initialised CUDA (CUDA 10, the traces' era). CUDA >= 11.7 loads kernels lazily and needs less;
# ``--device cuda`` measures the real value per process (NVML's figure minus torch's reserved bytes).
CUDA_CONTEXT_BYTES = 781 * 10 ** 6
DEVICES = ("meta", "cpu", "cuda")
READY_TIMEOUT_S = 600.0


class BenchModelsError(RuntimeError):
    pass


# --- pure helpers -----------------------------------------------------------------------------------


def model_slowdown(victim: str, neighbour: str) -> float:
    """What the workload model says ``victim`` slows to beside an uncontrolled ``neighbour``."""
    return BY_NAME[victim].slowdown([(BY_NAME[neighbour].kind, 1.0)])


def parse_names(text: Optional[str], what: str) -> list[str]:
    from .evaluation.model_zoo import NAMES

    if text is None:
        return []
    if text.strip() == "all":
        return list(NAMES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in NAMES]
    if bad:
        raise BenchModelsError(f"{what} {', '.join(bad)}: unknown; allowed: {', '.join(NAMES)} or 'all'")
    return names


# --- memory without a GPU -----------------------------------------------------------------------


def traced_memory(name: str, device: str = "meta", batch: Optional[int] = None) -> dict:
    """One profile's steady-state step memory from ``memory_trace`` (no GPU needed)."""
    from .evaluation.memory_trace import trace_step
    from .evaluation.model_zoo import build

    loop = build(name, device=device, batch=batch)
    mem = trace_step(loop.model, loop.inputs, loop.step)
    return {"batch": loop.batch, "params": loop.param_count(), **mem.as_dict(),
            "with_context_bytes": mem.peak_bytes + CUDA_CONTEXT_BYTES, "step_flops": step_flops(loop)}


def step_flops(loop: Any) -> int:
    """Floating-point operations of one training step (matrix multiplies and convolutions, forward
    and backward, as ``torch.utils.flop_counter`` counts them): how a model's mini-batch time is
    scaled from a measured model of the same kind."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        loop.step()
    return int(counter.get_total_flops())


# --- the timed worker (a process of its own) ---------------------------------------------------------


class _UtilSampler:
    """Mean GPU utilisation and the largest memory NVML attributes to this process, sampled in the
    background while the timed window runs."""

    def __init__(self, period_s: float = 0.05) -> None:
        from sidecar.telemetry import NvmlTelemetry  # raises TelemetryError without NVML

        self._nvml = NvmlTelemetry()
        self._period = period_s
        self._stop = threading.Event()
        self._utils: list[float] = []
        self.process_mem_bytes = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        pid = os.getpid()
        while not self._stop.wait(self._period):
            gpus, procs = self._nvml.sample({})
            if gpus:
                self._utils.append(gpus[0].utilization)
            for p in procs:
                if p.pid == pid and p.memory_bytes:
                    self.process_mem_bytes = max(self.process_mem_bytes, p.memory_bytes)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self._nvml.close()
        return sum(self._utils) / len(self._utils) if self._utils else float("nan")


def worker(name: str, device: str, batch: Optional[int], warmup: int, threads: Optional[int]) -> dict:
    import torch

    from .evaluation.model_zoo import build

    if threads:
        torch.set_num_threads(threads)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    loop = build(name, device=device, batch=batch)
    for _ in range(warmup):
        loop.step()
    sync()
    print("ready", flush=True)
    line = sys.stdin.readline().split()
    if len(line) != 2 or line[0] != "go":
        raise BenchModelsError(f"worker {name}: expected 'go SECONDS' on stdin, got {line!r}")
    window_s = float(line[1])
    sampler = _UtilSampler() if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        sampler.start()
    n, t0 = 0, time.perf_counter()
    while True:
        loop.step()
        sync()  # a mini-batch ends when its kernels do, not when Python has queued them
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= window_s:
            break
    out: dict[str, Any] = {"name": name, "batch": loop.batch, "steps": n, "iter_ms": elapsed / n * 1000.0}
    if cuda:
        out["util"] = sampler.stop()
        out["nvml_process_mem_bytes"] = sampler.process_mem_bytes
        out["max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["max_reserved_bytes"] = torch.cuda.max_memory_reserved()
        out["gpu_name"] = torch.cuda.get_device_name()
    return out


# --- orchestration ----------------------------------------------------------------------------------


def _worker_cmd(name: str, a: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "slurm_antman.bench_models", "--worker", name, "--device", a.device,
           "--warmup", str(a.warmup)]
    if a.batch:
        cmd += ["--batch", str(a.batch)]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    return cmd


def run_together(names: Sequence[str], a: argparse.Namespace) -> list[dict]:
    """Runs one worker per name at the same time and returns their results in order."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen(_worker_cmd(n, a), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for n in names]
    try:
        for n, p in zip(names, procs):
            line = p.stdout.readline().strip()
            if line != "ready":
                p.kill()
                raise BenchModelsError(f"worker {n} did not start: {line!r}; stderr: {p.stderr.read()[-2000:]}")
        for p in procs:  # both windows start within a millisecond of each other
            p.stdin.write(f"go {a.window_s}\n")
            p.stdin.flush()
        out = []
        for n, p in zip(names, procs):
            stdout, stderr = p.communicate(timeout=a.window_s * 20 + READY_TIMEOUT_S)
            if p.returncode != 0:
                raise BenchModelsError(f"worker {n} exited {p.returncode}: {stderr[-2000:]}")
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def measure(a: argparse.Namespace, log=lambda s: print(s, file=sys.stderr)) -> dict:
    import torch

    names = parse_names(a.profiles or "all", "--profiles")
    partners = parse_names(a.pairs_with, "--pairs-with")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise BenchModelsError("--device cuda: no CUDA GPU is visible to PyTorch; use --device meta to "
                               "measure memory without one")
    if partners and a.device == "meta":
        raise BenchModelsError("--pairs-with needs --device cuda (or cpu): meta tensors take no time")
    doc: dict[str, Any] = {"device": a.device, "torch": torch.__version__, "batch_override": a.batch,
                           "context_bytes_assumed": CUDA_CONTEXT_BYTES, "profiles": {}, "pairs": []}
    for n in names:
        log(f"antman bench models: {n}: tracing step memory ...")
        row: dict[str, Any] = {"traced": traced_memory(n, "meta", a.batch)}
        if a.device != "meta":
            log(f"antman bench models: {n}: timing alone on {a.device} ...")
            row["solo"] = run_together([n], a)[0]
        doc["profiles"][n] = row
    done: set[frozenset] = set()
    for n in names:
        for m in partners:
            key = frozenset((n, m)) if n != m else frozenset((n, "self"))
            if key in done:
                continue
            done.add(key)
            log(f"antman bench models: {n} beside {m} ...")
            ra, rb = run_together([n, m], a)
            pair = {"a": n, "b": m, "iter_ms_a": ra["iter_ms"], "iter_ms_b": rb["iter_ms"]}
            for who, r, other in (("a", ra, m), ("b", rb, n)):
                pair[f"slowdown_{who}"] = r["iter_ms"] / _solo_iter_ms(doc, r["name"], a)
                pair[f"model_slowdown_{who}"] = model_slowdown(r["name"], other)
            if a.device == "cuda":
                pair["util_together"] = ra.get("util")
            doc["pairs"].append(pair)
    return doc


def _solo_iter_ms(doc: dict, name: str, a: argparse.Namespace) -> Optional[float]:
    row = doc["profiles"].get(name)
    if row is None:  # a partner outside --profiles: time it alone once
        row = doc["profiles"][name] = {"traced": traced_memory(name, "meta", a.batch)}
    if "solo" not in row:
        row["solo"] = run_together([name], a)[0]
    return row["solo"]["iter_ms"]


def table(doc: dict) -> str:
    """Measured against the numbers the workload model uses ("model" columns)."""
    head = (f"{'profile':<20}{'batch':>6}{'params M':>10}{'GFLOP':>8}{'peak GiB':>10}{'+ctx GiB':>10}"
            f"{'model GiB':>10}{'iter ms':>9}{'model ms':>9}{'util':>6}{'model':>6}")
    lines = [head]
    for n, r in doc["profiles"].items():
        p, t, s = BY_NAME[n], r["traced"], r.get("solo", {})
        lines.append(
            f"{n:<20}{t['batch']:>6}{t['params'] / 1e6:>10.1f}{t['step_flops'] / 1e9:>8.0f}"
            f"{t['peak_bytes'] / GiB:>10.2f}{t['with_context_bytes'] / GiB:>10.2f}{p.mem_gib:>10.2f}"
            f"{_fmt(s.get('iter_ms'), 9, '.1f')}{p.iter_ms:>9.0f}{_fmt(s.get('util'), 6, '.2f')}{p.sm_util:>6.2f}")
    for q in doc["pairs"]:
        lines.append(f"pair {q['a']} + {q['b']}: slowdown {q['slowdown_a']:.2f} / {q['slowdown_b']:.2f} "
                     f"(model {q['model_slowdown_a']:.2f} / {q['model_slowdown_b']:.2f})")
    return "\n".join(lines)


def _fmt(v: Optional[float], width: int, spec: str) -> str:
    return f"{v:>{width}{spec}}" if isinstance(v, (int, float)) and math.isfinite(v) else f"{'-':>{width}}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="antman bench models", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=DEVICES, default=None,
                   help="cuda: time and measure on the GPU; meta: memory only, no GPU needed "
                        "(default: cuda if PyTorch sees one, else meta); cpu: tests the machinery")
    p.add_argument("--profiles", help="comma-separated profiles, or 'all' (default)")
    p.add_argument("--pairs-with", help="also run every profile beside each of these (comma list or 'all')")
    p.add_argument("--batch", type=int, help="override every profile's batch (quick checks)")
    p.add_argument("--window-s", type=float, default=10.0, help="timed window per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before the window")
    p.add_argument("--threads", type=int, help="torch threads per worker (cpu)")
    p.add_argument("--json", action="store_true", help="print the JSON document")
    p.add_argument("--out", help="write the JSON document to this file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parser().parse_args(argv)
    if a.batch is not None and a.batch < 1:
        print("antman bench models: --batch must be at least 1", file=sys.stderr)
        return 2
    if a.window_s <= 0 or a.warmup < 1:
        print("antman bench models: --window-s must be positive and --warmup at least 1", file=sys.stderr)
        return 2
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "meta"
    try:
        if a.worker:
            print(json.dumps(worker(a.worker, a.device, a.batch, a.warmup, a.threads)), flush=True)
            return 0
        doc = measure(a)
    except BenchModelsError as e:
        print(f"antman bench models: {e}", file=sys.stderr)
        return 2
    text = json.dumps(doc, indent=1, default=str)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text if a.json else table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
