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
- ``--duties 1.0,0.5``: also run each model, alone and in every pair, at reduced duty, the way a
  production job with a data-loader stall keeps the GPU only part of its benchmark busy: between
  steps the worker sleeps on the CPU (the GPU idle) for ``1/b - 1`` times its solo step time. Each pair
  at each combination of duties checks the interference formula of ``evaluation.workloads``
  (``slowdown = 1 - b_i + b_i / (1 - b_j + b_j / d_ij)``) against the measurement, calibrated with the same run's
  full-duty pair (docs/workload_model.md, "Checking the interference formula on a GPU").
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
import random
import sys
import threading
import time
from typing import Any, Optional, Sequence

import slurm_antman

from slurm_antman.lab.evaluation.workloads import BY_NAME, GiB, pair_slowdown, slowdown_beside
from slurm_antman.lab.worker_pool import run_released

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


def parse_duties(text: Optional[str]) -> list[float]:
    """``--duties``, highest first. 1.0 is always in: the full-duty pair calibrates the formula."""
    out = []
    for part in (text if text is not None else "1.0").split(","):
        try:
            duty = float(part)
        except ValueError:
            duty = math.nan
        if not 0.0 < duty <= 1.0:  # NaN fails too
            raise BenchModelsError(f"--duties {part.strip()!r}: each duty must be a number in (0, 1], "
                                   "comma-separated (e.g. --duties 1.0,0.5)")
        out.append(duty)
    return sorted(set(out) | {1.0}, reverse=True)


def stall_ms(solo_iter_ms: float, duty: float) -> float:
    """The mean CPU-side sleep per step that keeps a job busy ``duty`` of its time alone: one
    full-duty mini-batch of work in every ``solo_iter_ms / duty``."""
    return (1.0 / duty - 1.0) * solo_iter_ms


def measured_duty(nominal: float, at_duty: dict, full: dict) -> tuple[float, str]:
    """The duty the formula is given, and where it came from. The formula's duty is the job's GPU
    utilisation over its benchmark's (``Profile.duty``), so NVML's utilisation at this duty over the
    one at full duty where both were measured; without NVML (``--device cpu``) the nominal duty."""
    u, u_full = at_duty.get("util"), full.get("util")
    if _finite(u) and _finite(u_full) and u_full > 0:
        return min(1.0, max(0.0, u / u_full)), "nvml"
    return nominal, "nominal"


def time_duty(at_duty: dict, full: dict) -> float:
    """The busy fraction of the run at this duty over the full-duty run's, from the worker's clock:
    the cross-check the sleep does what it should, on any device (on a GPU "busy" includes the
    CPU's kernel launches, which is why the formula takes NVML's figure there)."""
    return (at_duty["busy_ms"] / at_duty["iter_ms"]) / (full["busy_ms"] / full["iter_ms"])


def predicted_slowdown(full_duty_slowdown: float, duty_victim: float, duty_neighbour: float,
                       share_neighbour: float = 1.0) -> float:
    """The formula of ``workloads.pair_slowdown`` with a measured pair as its calibration instead of
    Gavel's: a slowdown of the whole mini-batch, idle time included. Not clamped at 1, so at duty 1
    it returns the calibration exactly, noise and all."""
    return slowdown_beside(duty_victim, duty_neighbour * share_neighbour, full_duty_slowdown)


def duty_combinations(duties: Sequence[float], same: bool) -> list[tuple[float, float]]:
    """(duty_a, duty_b) to run a pair at, the full-duty calibration first; a model beside itself
    needs (1.0, 0.5) once, not also (0.5, 1.0)."""
    return [(da, db) for da in duties for db in duties if not (same and da < db)]


def pair_entry(a: str, b: str, ra: dict, rb: dict, solo_a: dict, solo_b: dict,
               full: Optional[dict] = None) -> dict:
    """One pair at one combination of duties (``doc["pairs"]``): each side's mini-batch time, stall
    included, over its solo one at the same duty, next to the formula's prediction from ``full`` (this
    pair at full duty, measured in the same run; None: this is it) and from Gavel's pairs. ``solo_*``
    are the solo records at the duties run (``_solo``)."""
    q: dict[str, Any] = {"a": a, "b": b, "duty_a": solo_a["duty"], "duty_b": solo_b["duty"],
                         "iter_ms_a": ra["iter_ms"], "iter_ms_b": rb["iter_ms"]}
    for who, r, solo in (("a", ra, solo_a), ("b", rb, solo_b)):
        q[f"slowdown_{who}"] = r["iter_ms"] / solo["iter_ms"]
        q[f"busy_ms_{who}"] = r.get("busy_ms")
    calibration = full if full is not None else q
    for who, victim, other, mine, theirs in (("a", a, b, solo_a, solo_b), ("b", b, a, solo_b, solo_a)):
        bv, bn = mine["formula_duty"], theirs["formula_duty"]
        q[f"model_slowdown_{who}"] = model_slowdown(victim, other)
        q[f"formula_duty_{who}"] = bv
        q[f"formula_slowdown_{who}"] = predicted_slowdown(calibration[f"slowdown_{who}"], bv, bn)
        q[f"formula_gavel_slowdown_{who}"] = pair_slowdown(BY_NAME[victim].kind, BY_NAME[other].kind, bv, bn)
        q[f"formula_error_{who}"] = abs(q[f"formula_slowdown_{who}"] - q[f"slowdown_{who}"])
    return q


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def parse_names(text: Optional[str], what: str) -> list[str]:
    from slurm_antman.lab.evaluation.model_zoo import NAMES

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
    from slurm_antman.lab.evaluation.memory_trace import trace_step
    from slurm_antman.lab.evaluation.model_zoo import build

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
        from slurm_antman.sidecar.telemetry import NvmlTelemetry

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


def worker(name: str, device: str, batch: Optional[int], warmup: int, threads: Optional[int],
           mean_stall_ms: float = 0.0) -> dict:
    import torch

    from slurm_antman.lab.evaluation.model_zoo import build

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
    # The stall is drawn from [0, 2 x its mean] each step, and comes before the step, so the first one
    # also gives a random phase: a fixed stall would lock two equal jobs started on the same "go"
    # into being busy together and idle together, not the random overlap the formula assumes.
    # Production data-loader stalls vary as well.
    rng, stall_s = random.Random(), mean_stall_ms / 1000.0
    n, busy, t0 = 0, 0.0, time.perf_counter()
    while True:
        if stall_s > 0:
            time.sleep(rng.uniform(0.0, 2.0 * stall_s))  # after the last sync: the GPU idles
        s0 = time.perf_counter()
        loop.step()
        sync()  # a mini-batch ends when its kernels do, not when Python has queued them
        busy += time.perf_counter() - s0
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= window_s:
            break
    out: dict[str, Any] = {"name": name, "batch": loop.batch, "steps": n, "iter_ms": elapsed / n * 1000.0,
                           "busy_ms": busy / n * 1000.0, "stall_ms": mean_stall_ms}
    if cuda:
        out["util"] = sampler.stop()
        out["nvml_process_mem_bytes"] = sampler.process_mem_bytes
        out["max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["max_reserved_bytes"] = torch.cuda.max_memory_reserved()
        out["gpu_name"] = torch.cuda.get_device_name()
    return out


# --- orchestration ----------------------------------------------------------------------------------


def _worker_cmd(name: str, a: argparse.Namespace, stall: float = 0.0) -> list[str]:
    cmd = [sys.executable, "-m", "slurm_antman.lab.bench.models", "--worker", name, "--device", a.device,
           "--warmup", str(a.warmup)]
    if stall > 0:
        cmd += ["--stall-ms", repr(stall)]
    if a.batch:
        cmd += ["--batch", str(a.batch)]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    return cmd


def run_together(names: Sequence[str], a: argparse.Namespace,
                 stalls_ms: Optional[Sequence[float]] = None) -> list[dict]:
    """Runs one worker per name at the same time (each with its stall per step, none by default)
    and returns their results in order."""
    # The directory that holds the slurm_antman package, for the child processes' imports.
    root = os.path.dirname(os.path.dirname(os.path.abspath(slurm_antman.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    stalls_ms = stalls_ms or [0.0] * len(names)
    return run_released([_worker_cmd(n, a, st) for n, st in zip(names, stalls_ms)], names, env,
                        f"go {a.window_s}", a.window_s * 20 + READY_TIMEOUT_S, BenchModelsError)


def measure(a: argparse.Namespace, log=lambda s: print(s, file=sys.stderr)) -> dict:
    import torch

    names = parse_names(a.profiles or "all", "--profiles")
    partners = parse_names(a.pairs_with, "--pairs-with")
    duties = parse_duties(a.duties)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise BenchModelsError("--device cuda: no CUDA GPU is visible to PyTorch; use --device meta to "
                               "measure memory without one")
    if partners and a.device == "meta":
        raise BenchModelsError("--pairs-with needs --device cuda (or cpu): meta tensors take no time")
    if duties != [1.0] and a.device == "meta":
        raise BenchModelsError("--duties needs --device cuda (or cpu): meta tensors take no time")
    doc: dict[str, Any] = {"device": a.device, "torch": torch.__version__, "batch_override": a.batch,
                           "context_bytes_assumed": CUDA_CONTEXT_BYTES, "duties": duties, "profiles": {},
                           "pairs": []}
    for n in names:
        log(f"antman bench models: {n}: tracing step memory ...")
        doc["profiles"][n] = {"traced": traced_memory(n, "meta", a.batch)}
        if a.device != "meta":
            for duty in duties:
                log(f"antman bench models: {n}: timing alone on {a.device} at duty {duty:g} ...")
                _solo(doc, n, a, duty)
    done: set[frozenset] = set()
    for n in names:
        for m in partners:
            key = frozenset((n, m)) if n != m else frozenset((n, "self"))
            if key in done:
                continue
            done.add(key)
            full = None
            for da, db in duty_combinations(duties, same=n == m):
                sa, sb = _solo(doc, n, a, da), _solo(doc, m, a, db)
                log(f"antman bench models: {n} at duty {da:g} beside {m} at duty {db:g} ...")
                ra, rb = run_together([n, m], a, [sa["stall_ms"], sb["stall_ms"]])
                pair = pair_entry(n, m, ra, rb, sa, sb, full)
                if a.device == "cuda":
                    pair["util_together"] = ra.get("util")
                doc["pairs"].append(pair)
                full = full or pair
    return doc


def _solo(doc: dict, name: str, a: argparse.Namespace, duty: float) -> dict:
    """The solo record of ``name`` at ``duty`` (``row["solo"]`` at 1.0, ``row["solo_at_duty"]``
    below), timed on first use: a partner outside --profiles is timed here."""
    row = doc["profiles"].get(name)
    if row is None:
        row = doc["profiles"][name] = {"traced": traced_memory(name, "meta", a.batch)}
    if "solo" not in row:
        row["solo"] = _with_duty(run_together([name], a)[0], 1.0, None)
    if duty == 1.0:
        return row["solo"]
    at = row.setdefault("solo_at_duty", {})
    key = f"{duty:g}"
    if key not in at:  # the stall comes from this run's own full-duty time, not the profile's
        stall = stall_ms(row["solo"]["iter_ms"], duty)
        at[key] = _with_duty(run_together([name], a, [stall])[0], duty, row["solo"])
    return at[key]


def _with_duty(r: dict, duty: float, full: Optional[dict]) -> dict:
    full = full if full is not None else r
    r["duty"] = duty
    r["formula_duty"], r["duty_source"] = measured_duty(duty, r, full)
    r["duty_time"] = time_duty(r, full)
    return r


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
    for n, r in doc["profiles"].items():
        for key, s in r.get("solo_at_duty", {}).items():
            lines.append(f"solo {n} at duty {key}: iter ms {s['iter_ms']:.1f} (stall {s['stall_ms']:.1f}), "
                         f"util {_fmt(s.get('util'), 0, '.2f')}, duty {s['formula_duty']:.2f} "
                         f"({s['duty_source']}), by the clock {s['duty_time']:.2f}")
    for q in doc["pairs"]:
        lines.append(f"pair {q['a']}@{q['duty_a']:g} + {q['b']}@{q['duty_b']:g}: "
                     f"slowdown {q['slowdown_a']:.2f} / {q['slowdown_b']:.2f}, "
                     f"formula {q['formula_slowdown_a']:.2f} / {q['formula_slowdown_b']:.2f} "
                     f"(error {q['formula_error_a']:.2f} / {q['formula_error_b']:.2f}), "
                     f"model {q['formula_gavel_slowdown_a']:.2f} / {q['formula_gavel_slowdown_b']:.2f}")
    return "\n".join(lines)


def _fmt(v: Optional[float], width: int, spec: str) -> str:
    return f"{v:>{width}{spec}}" if _finite(v) else f"{'-':>{width}}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="antman bench models", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=DEVICES, default=None,
                   help="cuda: time and measure on the GPU; meta: memory only, no GPU needed "
                        "(default: cuda if PyTorch sees one, else meta); cpu: tests the machinery")
    p.add_argument("--profiles", help="comma-separated profiles, or 'all' (default)")
    p.add_argument("--pairs-with", help="also run every profile beside each of these (comma list or 'all')")
    p.add_argument("--batch", type=int, help="override every profile's batch (quick checks)")
    p.add_argument("--duties", default="1.0",
                   help="comma list of duties in (0, 1] to run every model at, alone and in pairs: at "
                        "duty b a worker sleeps (1/b - 1) x its solo step time after each step, the GPU "
                        "idle; 1.0 always runs, it calibrates the check (default: 1.0)")
    p.add_argument("--window-s", type=float, default=10.0, help="timed window per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before the window")
    p.add_argument("--threads", type=int, help="torch threads per worker (cpu)")
    p.add_argument("--json", action="store_true", help="print the JSON document")
    p.add_argument("--out", help="write the JSON document to this file")
    # Shown, not hidden: whoever finds one in `ps` can look it up.
    p.add_argument("--worker", metavar="PROFILE",
                   help="internal, passed by the parent to each worker process: train this profile and print "
                        "its measurements as one JSON line")
    p.add_argument("--stall-ms", type=float, default=0.0,
                   help="internal (with --worker): mean idle milliseconds before each step (the duty's sleep)")
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
            print(json.dumps(worker(a.worker, a.device, a.batch, a.warmup, a.threads, a.stall_ms)), flush=True)
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
